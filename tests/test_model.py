"""The engine's own target forward against transformers' logits, and the KV cache mechanics."""

import pytest
import torch
from conftest import write_tiny_llama

from spechead import kernels
from spechead.errors import SpecheadError
from spechead.kernels.linear import Projection
from spechead.model.layers import causal_mask
from spechead.model.loading import load_target


def hf_logits(folder, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]


@pytest.mark.paths
def test_parity_with_transformers_tiny(tiny_dir):
    target, _ = load_target(str(tiny_dir))
    target.setup_cache(128)
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = target(ids, 0).logits
    ref = hf_logits(tiny_dir, ids)
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_parity_with_transformers_demo(demo_session):
    """At fp32 the engine is transformers' model, to float rounding (the demo session itself runs at gguf)."""
    ids = torch.tensor(demo_session.encode("Name three rivers in Europe."))
    target, folder = load_target("demo", "fp32")
    target.setup_cache(64)
    with torch.inference_mode():
        ours = target(ids, 0).logits
    ref = hf_logits(folder, ids)
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.paths
def test_incremental_decoding_matches_full_forward(tiny_target):
    """Prefill + one-token steps through the cache give the logits of one full forward."""
    t = tiny_target
    t.setup_cache(64)
    ids = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = t(ids, 0).logits
        t(ids[:5], 0)
        steps = [t(ids[i : i + 1], i).logits[0] for i in range(5, 12)]
    assert torch.allclose(torch.stack(steps), full[5:], atol=1e-5)


@pytest.mark.paths
def test_tree_mask_forward_matches_separate_branches(tiny_target):
    """Two branches verified in one forward (tree mask, depth positions) equal each branch run alone."""
    t = tiny_target
    t.setup_cache(64)
    g = torch.Generator().manual_seed(2)
    prefix, a, b = (torch.randint(0, 64, (n,), generator=g) for n in (6, 2, 2))
    with torch.inference_mode():
        t(prefix, 0)
        tokens = torch.cat([a, b])  # nodes 0,1 = branch a (chain), 2,3 = branch b (chain)
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
        mask = torch.cat([torch.ones(4, 6, dtype=torch.bool), tree], dim=1)
        pos = torch.tensor([6, 7, 6, 7])
        both = t(tokens, 6, positions=pos, mask=mask).logits
        ref_a = t(a, 6).logits
        ref_b = t(b, 6).logits
    assert torch.allclose(both[:2], ref_a, atol=1e-5)
    assert torch.allclose(both[2:], ref_b, atol=1e-5)


def test_cache_move_compacts_slots_in_every_layer(tiny_target):
    """An accepted path's slots move to the front of its range in every layer's keys and values, on its lane only."""
    t = tiny_target
    t.setup_cache(32, lanes=2)
    caches = [layer.self_attn.cache for layer in t.model.layers]
    for i, cache in enumerate(caches):
        for lane in range(2):
            cache.k[lane, :, :8] = torch.arange(8.0)[None, :, None] + 100 * i + 10 * lane
            cache.v[lane, :, :8] = -cache.k[lane, :, :8]
    t.move_cache(torch.tensor([3, 5, 7]), 3, lane=1)
    for i, cache in enumerate(caches):
        moved = [100.0 * i + 10 + s for s in (0, 1, 2, 3, 5, 7, 6, 7)]
        assert cache.k[1, -1, :8, -1].tolist() == moved and cache.v[1, 0, :8, 0].tolist() == [-m for m in moved]
        assert cache.k[0, 0, :8, 0].tolist() == [100.0 * i + s for s in range(8)]


def test_causal_mask_offsets():
    m = causal_mask(2, 5, torch.device("cpu"))
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_missing_and_corrupt_targets(tmp_path):
    with pytest.raises(SpecheadError, match="not found"):
        load_target(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SpecheadError, match="invalid config"):
        load_target(str(tmp_path))


def test_corrupt_weights(tiny_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (bad / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(SpecheadError, match="corrupt"):
        load_target(str(bad))


@pytest.mark.paths
def test_prepacked_logits_match_the_modules(tiny_dir):
    """Putting the projections on the kernel changes speed only: same logits (1e-5), the state dict's names and
    tied weights kept. Where no build runs, the model keeps its modules."""
    target, _ = load_target(str(tiny_dir))
    target.setup_cache(64)
    ids = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(2))
    names = set(target.state_dict())
    with torch.inference_mode():
        ref = [target(ids[:16], 0).logits, target(ids[16:20], 16).logits, target(ids[16:19], 16).logits]
        assert target.prepack() == kernels.available()
        got = [target(ids[:16], 0).logits, target(ids[16:20], 16).logits, target(ids[16:19], 16).logits]
    assert isinstance(target.lm_head, Projection) == kernels.available() and set(target.state_dict()) == names
    if target.config.tie_word_embeddings:
        assert target.lm_head.weight is target.model.embed_tokens.weight
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


@pytest.mark.paths
@pytest.mark.skipif(not kernels.available(), reason="spechead's kernel is unavailable here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_projections_rows_do_not_depend_on_the_row_count(dtype):
    """The row-count property through ``Projection``: at every row count from 1 to 64, each row's result is bitwise
    its 1-row call's, outside a prefill and inside one up to its prefill reach; the bias and the input's dtype
    are kept."""
    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(96, 80, bias=True).to(dtype)
    proj = Projection(linear)
    x = torch.randn(64, 96, generator=g).to(dtype)
    with torch.inference_mode():
        for prefill in (False, True):
            rows = min(64, proj.prefill_rows) if prefill else 64
            alone = torch.cat([proj(x[i : i + 1], prefill) for i in range(rows)])
            assert alone.dtype == dtype
            torch.testing.assert_close(alone.float(), linear(x[:rows]).float(), rtol=2e-2, atol=2e-2)
            for m in range(1, rows + 1):
                assert torch.equal(proj(x[:m], prefill), alone[:m]), (prefill, m)


def test_gguf_conversion_parses_the_file_once(tmp_path, monkeypatch):
    """The demo's GGUF converted to the same weights as the cached folder, with one parse of the file (transformers
    asks for three: Gemma 3's vocabulary makes each cost minutes)."""
    import gguf

    from spechead.model.loading import PACKAGED_TARGETS, convert_gguf, resolve_target

    parses, original = [], gguf.GGUFReader

    def counting(path, *args, **kwargs):
        parses.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    demo = PACKAGED_TARGETS["demo"]
    out = convert_gguf(demo.gguf_path(tmp_path), tmp_path / "converted")
    assert len(parses) == 1 and gguf.GGUFReader is counting
    from safetensors.torch import load_file

    got, want = (load_file(f / "model.safetensors") for f in (out, resolve_target("demo")))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.paths
def test_a_prompt_takes_the_same_path_however_wide_the_layouts(tmp_path):
    """A prompt's bits depend on its length only, never on the tree or batch a decoder laid the target out for
    (a batched server's text starts from `spechead generate`'s); the LM head's rows and a verification's rows take
    the kernel at any row count."""
    # wide enough (K = 256) that the kernel's and the library GEMM's sums differ in their last bits
    target, _ = load_target(str(write_tiny_llama(tmp_path, vocab=256, layers=2, hidden=256)))
    target.setup_cache(400)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        target.prepack()
        narrow = target(ids, 0)
        target.prepack()  # laid out again (as each decoder a server builds does): the same prompt bits
        wide = target(ids, 0)
        assert torch.equal(narrow.logits, wide.logits) and torch.equal(narrow.hidden, wide.hidden)
        if kernels.available():
            # a head that asks for every prompt row (NanoSpec's top-k over the prompt) gets AR's bits in the last
            # one, on which the first token is chosen: on the kernel the LM head's rows are a decode step's at any
            # row count (F.linear's are not: without the kernel no path is bitwise across row counts)
            assert torch.equal(target(ids, 0, logits_rows=slice(-1, None)).logits[-1], wide.logits[-1])
            # outside a prompt, 300 rows take the kernel: each row as alone
            h = wide.hidden
            together = target.lm_head(h)
            assert all(torch.equal(target.lm_head(h[i : i + 1])[0], together[i]) for i in (0, 150, 299))
            qkv = target.model.layers[0].self_attn.qkv_proj
            together = qkv(h)
            assert all(torch.equal(qkv(h[i : i + 1])[0], together[i]) for i in (0, 150, 299))
