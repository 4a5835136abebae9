"""Drafter checkpoints: published EAGLE layouts written and read exactly, mismatches refused."""

import json

import pytest
import torch

from spechead.errors import SpecheadError
from spechead.model.drafter import load_drafter, random_drafter

EAGLE2_NAMES = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
}
EAGLE3_NAMES = {
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def write_published_eagle2(folder, target, bias=False):
    """A checkpoint as the EAGLE repo ships it: pytorch_model.bin with embed_tokens, config with `bias`."""
    c = target.config
    d, kv = c.hidden_size, c.num_key_value_heads * c.head_dim
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embed_tokens.weight": (c.vocab_size, d),
        "fc.weight": (d, 2 * d),
        "layers.0.self_attn.q_proj.weight": (d, d),
        "layers.0.self_attn.k_proj.weight": (kv, d),
        "layers.0.self_attn.v_proj.weight": (kv, d),
        "layers.0.self_attn.o_proj.weight": (d, d),
        "layers.0.mlp.gate_proj.weight": (c.intermediate_size, d),
        "layers.0.mlp.up_proj.weight": (c.intermediate_size, d),
        "layers.0.mlp.down_proj.weight": (d, c.intermediate_size),
        "layers.0.post_attention_layernorm.weight": (d,),
    }
    if bias:
        shapes["fc.bias"] = (d,)
    state = {k: (torch.randn(s, generator=g) * 0.05).half() for k, s in shapes.items()}
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": d,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "torch_dtype": "float16",
        "model_type": "llama",
        "rope_theta": 10000.0,
    }
    if not bias:
        cfg["bias"] = False
    (folder / "config.json").write_text(json.dumps(cfg))
    return state


@pytest.mark.parametrize("bias", [False, True])
def test_load_published_eagle2_layout(tiny_target, tmp_path, bias):
    state = write_published_eagle2(tmp_path / "e2", tiny_target, bias)
    drafter = load_drafter(tmp_path / "e2", tiny_target)
    assert drafter.arch == "eagle2"
    assert torch.equal(drafter.fc.weight, state["fc.weight"].float())
    assert (drafter.fc.bias is not None) == bias
    assert drafter.embed is tiny_target.model.embed_tokens  # the target's table, not the checkpoint's copy


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_save_load_round_trip(tiny_target, tmp_path, arch):
    d = random_drafter(tiny_target, arch, seed=1)
    d.save(tmp_path / arch, dtype=torch.float32)
    from safetensors import safe_open

    with safe_open(tmp_path / arch / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert names == (EAGLE2_NAMES if arch == "eagle2" else EAGLE3_NAMES - {"d2t", "t2d"})
    back = load_drafter(tmp_path / arch, tiny_target)
    for (k, a), (_, b) in zip(d.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_eagle3_reduced_vocab_layout(tiny_target, tmp_path):
    V = tiny_target.config.vocab_size
    d = random_drafter(tiny_target, "eagle3", seed=2, draft_vocab_size=16)
    keep = torch.arange(0, V, 4)
    d.set_draft_vocab(keep)
    d.save(tmp_path / "e3", dtype=torch.float32)
    back = load_drafter(tmp_path / "e3", tiny_target)
    w, ids = back.head_weight(tiny_target)
    assert w.shape == (16, tiny_target.config.hidden_size)
    assert torch.equal(ids, keep) and int(back.t2d.sum()) == 16
    assert back.d2t.dtype == torch.long and back.t2d.dtype == torch.bool


def test_mismatched_drafter_refused(tiny_target, tmp_path):
    write_published_eagle2(tmp_path / "e2", tiny_target)
    cfg = json.loads((tmp_path / "e2" / "config.json").read_text())
    cfg["vocab_size"] = 999
    (tmp_path / "e2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecheadError, match="vocabulary"):
        load_drafter(tmp_path / "e2", tiny_target)
    cfg["vocab_size"], cfg["hidden_size"] = tiny_target.config.vocab_size, 48
    (tmp_path / "e2" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecheadError, match="hidden size"):
        load_drafter(tmp_path / "e2", tiny_target)


def test_missing_and_corrupt_drafter(tiny_target, tmp_path):
    with pytest.raises(SpecheadError, match="not found"):
        load_drafter(tmp_path / "nope", tiny_target)
    d = random_drafter(tiny_target, "eagle2")
    d.save(tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(SpecheadError, match="corrupt"):
        load_drafter(tmp_path / "c", tiny_target)
    d.save(tmp_path / "t")
    (tmp_path / "t" / "config.json").write_text("{")
    with pytest.raises(SpecheadError, match="invalid drafter config"):
        load_drafter(tmp_path / "t", tiny_target)


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_a_laid_out_drafter_drafts_trains_and_saves_as_before(tiny_target, tmp_path, arch):
    """Decoders lay the drafter's projections out for the few-row kernel (``Drafter.prepack``): the same pass
    within fp32 rounding, the same state dict, gradients as before, and an in-place update seen by the next pass."""
    d = random_drafter(tiny_target, arch, seed=3)
    d.setup_cache(64)
    t = 5
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, tiny_target.config.vocab_size, (t,), generator=g)
    width = d.fc.weight.shape[1] if arch == "eagle3" else tiny_target.config.hidden_size
    feats, pos = torch.randn(t, width, generator=g), torch.arange(t)

    def run():
        with torch.inference_mode():
            return d(tokens, feats, 0, pos, None).clone()

    names, before = set(d.state_dict()), run()
    d.prepack()
    assert set(d.state_dict()) == names
    torch.testing.assert_close(run(), before, rtol=1e-5, atol=1e-5)
    d.train()
    loss = d(tokens, feats, 0, pos, None).square().sum()
    loss.backward()
    assert d.fc.weight.grad is not None and d.fc.weight.grad.abs().sum() > 0
    with torch.no_grad():
        d.fc.weight.mul_(2.0)
    d.eval()
    changed = run()
    plain = random_drafter(tiny_target, arch, seed=3)
    plain.load_state_dict(d.state_dict())
    plain.setup_cache(64)
    with torch.inference_mode():
        torch.testing.assert_close(changed, plain(tokens, feats, 0, pos, None), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, before)
    d.save(tmp_path / arch, dtype=torch.float32)
    back = load_drafter(tmp_path / arch, tiny_target)
    assert set(back.state_dict()) == names


def test_a_quantized_eagle2_layer_runs_as_one_op_and_gives_the_modules_bits(tiny_target):
    """Beside an integer target the EAGLE-2 drafter is fused and quantized; its layer then runs as the kernels'
    ``decoder_layers`` (no input norm): a prefill, a step and a tree give bitwise what the modules give."""
    from spechead import kernels

    if not kernels.available():
        pytest.skip("spechead's kernel is not built on this machine")
    d = random_drafter(tiny_target, "eagle2", seed=4)
    d.prepack("q8")
    d.setup_cache(64)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, tiny_target.config.vocab_size, (12,), generator=g)
    feats = torch.randn(12, tiny_target.config.hidden_size, generator=g)
    tree = torch.ones(3, 11, dtype=torch.bool)
    tree[:, 8:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    runs = {}
    with torch.inference_mode():
        for fused in (True, False):
            d._fused = None if fused else ()  # () keeps the modules
            x = d.fc(torch.cat([d.embed(tokens[:1]), feats[:1]], dim=-1))
            assert (d.run_layer(x, 0, None, d.rotary(torch.arange(1))) is not None) == fused
            prefill = d(tokens[:8], feats[:8], 0, torch.arange(8), None)
            step = d(tokens[8:9], feats[8:9], 8, torch.arange(8, 9), None)
            nodes = [8, 10, 11]  # node 0 is the step's own pair, 1 and 2 its children
            branch = d(tokens[nodes], feats[nodes], 8, torch.tensor([8, 9, 9]), tree)
            runs[fused] = (prefill, step, branch)
    for a, b in zip(runs[True], runs[False], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(runs[True][2][0], runs[True][1][0])  # the tree's first node is the step it stands for
