"""Read a GGUF checkpoint's weights straight into ``QuantBlocks``, without a float copy of its quantized matrices.

Q8_0, Q4_0, Q4_1, Q5_0 and Q4_K are executed as stored: their bytes become blocks of 32 whose ``dequantize()`` is
bit-for-bit what ``gguf.quants.dequantize`` gives. Other types (Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, IQ*, F16, BF16,
and F32 matrices) have no exact block form here: they are dequantized a few rows at a time and requantized to q8,
and ``GGUFWeights.requantized`` says by how much each moved. Names, the Llama q/k row order and Gemma's stored
1 + w norms are turned into what the Hugging Face checkpoint (and transformers' GGUF loader) holds.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from spechead.errors import SpecheadError
from spechead.kernels.quant import BLOCK, QuantBlocks, quantize

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType, GGUFReader

ARCHS = ("llama", "gemma3")
CHUNK = 1 << 22  # weights per slice of rows decoded at once: bounds the temporaries of the unpacking

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}
# the norms differ: in Llama ``ffn_norm`` is the MLP's input norm (HF: post_attention_layernorm); Gemma 3 has four
_ARCH_LAYER = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    },
}
_SKIP = {"rope_freqs.weight"}  # derived from the config (Llama 3 RoPE scaling), not a model parameter


@dataclass
class GGUFWeights:
    """A GGUF file's weights under Hugging Face parameter names: ``QuantBlocks`` for matrices, fp32 for the rest."""

    tensors: dict[str, QuantBlocks | torch.Tensor] = field(default_factory=dict)
    requantized: dict[str, tuple[str, float]] = field(default_factory=dict)  # name -> (GGUF type, max |w - w'|)
    arch: str = ""


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 stored at byte ``at`` of each block (raw [..., block bytes]) as fp32."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, q: np.ndarray) -> None:
    """ggml's 4-bit packing: byte j of a 16-byte run holds value j (low nibble) and value j + 16 (high)."""
    q[..., :16] = qs & 0x0F
    q[..., 16:] = qs >> 4


def _q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """block_q8_0: fp16 d, 32 int8. W = d * q."""
    return raw[..., 2:].view(np.int8), _f16(raw, 0), None


def _q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """block_q4_0: fp16 d, 16 bytes of nibbles. W = d * (q - 8) = d * q + (-8 d), both exact in fp32."""
    q = np.empty((*raw.shape[:-1], BLOCK), np.uint8)
    _nibbles(raw[..., 2:18], q)
    d = _f16(raw, 0)
    return q, d, -8.0 * d


def _q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """block_q4_1: fp16 d, fp16 m, 16 bytes of nibbles. W = d * q + m."""
    q = np.empty((*raw.shape[:-1], BLOCK), np.uint8)
    _nibbles(raw[..., 4:20], q)
    return q, _f16(raw, 0), _f16(raw, 2)


def _q5_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """block_q5_0: fp16 d, 4 bytes qh (bit j: value j's fifth bit), nibbles as Q4_0. W = d * (q - 16): int8."""
    q = np.empty((*raw.shape[:-1], BLOCK), np.uint8)
    _nibbles(raw[..., 6:22], q)
    q |= np.unpackbits(raw[..., 2:6], axis=-1, bitorder="little") << 4
    return q.view(np.int8) - np.int8(16), _f16(raw, 0), None


def _q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """block_q4_K: 256 values as 8 sub-blocks of 32. fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128
    bytes of nibbles (per 64 values: 32 low nibbles, then their 32 high nibbles). W = (d sc) q - (dmin mn): the
    products are exact in fp32, so each sub-block is one q4 block."""
    lead = raw.shape[:-1]
    s = raw[..., 4:16]
    sc, mn = np.empty((*lead, 8), np.uint8), np.empty((*lead, 8), np.uint8)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 0x3F, s[..., 4:8] & 0x3F
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = raw[..., 16:144].reshape(*lead, 4, 32)
    q = np.empty((*lead, 4, 2, 32), np.uint8)
    q[..., 0, :], q[..., 1, :] = qs & 0x0F, qs >> 4
    d, dmin = _f16(raw, 0)[..., None], _f16(raw, 2)[..., None]
    scale = d * sc.astype(np.float32)
    return q.reshape(*lead, 8, 32), scale, -(dmin * mn.astype(np.float32))


Decoder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]
# GGUF type name -> (values per stored block, bytes per stored block, decoder, spechead format)
EXACT: dict[str, tuple[int, int, Decoder, str]] = {
    "Q8_0": (32, 34, _q8_0, "q8"),
    "Q4_0": (32, 18, _q4_0, "q4"),
    "Q4_1": (32, 20, _q4_1, "q4"),
    "Q5_0": (32, 22, _q5_0, "q8"),
    "Q4_K": (256, 144, _q4_k, "q4"),
}


def _row_slices(n: int, k: int) -> list[slice]:
    """Slices of about ``CHUNK`` weights of an [n, k] matrix's rows."""
    step = max(1, CHUNK // k)
    return [slice(r0, min(n, r0 + step)) for r0 in range(0, n, step)]


def decode_blocks(raw: np.ndarray, type_name: str, k: int) -> QuantBlocks:
    """The exact blocks of a [N, K] matrix stored as ``type_name`` (one of ``EXACT``); ``raw``: its bytes [N, row
    bytes]. Decoded a slice of rows at a time into preallocated int8 / fp32 arrays: no float copy of W."""
    per, size, decoder, fmt = EXACT[type_name]
    n = raw.shape[0]
    if k % per or raw.shape[1] != k // per * size:
        raise SpecheadError(f"a {type_name} row of {k} values needs {k // per * size} bytes, got {raw.shape[1]}")
    q = np.empty((n, k), np.int8)
    scale = np.empty((n, k // BLOCK), np.float32)
    low = np.empty((n, k // BLOCK), np.float32) if fmt == "q4" else None
    for rows in _row_slices(n, k):
        part = raw[rows].reshape(-1, k // per, size)
        bq, bs, bm = decoder(part)
        q[rows] = bq.reshape(-1, k).view(np.int8)
        scale[rows] = bs.reshape(-1, k // BLOCK)
        if low is not None:
            low[rows] = bm.reshape(-1, k // BLOCK)
    mins = None if low is None else torch.from_numpy(low)
    return QuantBlocks(torch.from_numpy(q), torch.from_numpy(scale), mins, fmt)


def requantize_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, k: int) -> tuple[QuantBlocks, float]:
    """q8 blocks of a [N, K] matrix of any type ``gguf.quants`` dequantizes, and the largest |w - w'|. A slice of
    rows is in fp32 at a time (q8 blocks are per row, so slicing changes nothing)."""
    from gguf.quants import dequantize

    n = raw.shape[0]
    q = torch.empty((n, k), dtype=torch.int8)
    scale = torch.empty((n, k // BLOCK), dtype=torch.float32)
    err = 0.0
    for rows in _row_slices(n, k):
        try:
            w = torch.from_numpy(np.array(dequantize(raw[rows], qtype), dtype=np.float32).reshape(-1, k))
        except NotImplementedError as e:
            raise SpecheadError(f"GGUF type {qtype.name} is not supported: gguf cannot dequantize it") from e
        blocks = quantize(w, "q8")
        err = max(err, float((blocks.dequantize() - w).abs().max()))
        q[rows], scale[rows] = blocks.q, blocks.scale
    return QuantBlocks(q, scale, None, "q8"), err


def unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation for its RoPE layout (as transformers' GGUF loader does): within
    each head, GGUF row 2i + j is HF row j * (head_dim / 2) + i. ``blocks.rows(index)`` gives the HF order."""
    if heads <= 0 or n % (2 * heads):
        raise SpecheadError(f"cannot undo the q/k permutation: {n} rows are not {heads} heads of pairs")
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, None for one that is no parameter (``rope_freqs``)."""
    if gguf_name in _SKIP:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        base = ""
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    part = {**_LAYER, **_ARCH_LAYER[arch]}.get(m.group(2)) if m else None
    if m is None or part is None:
        raise SpecheadError(f"GGUF tensor {gguf_name!r} has no place in a {arch} model")
    return f"model.layers.{m.group(1)}.{part}.weight"


def _lean_reader(path: Path) -> GGUFReader:
    """A ``GGUFReader`` that keeps each metadata array as one slice of the file instead of one numpy view per
    element: the reader otherwise spends ~15 s and ~1.2 GB on a 262k-token vocabulary that weights never read.
    The arrays' ``contents()`` are then not meaningful; scalar fields, tensors and their layout are unchanged."""
    import gguf

    array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class Lean(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list]:
            if raw_type != array or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            sub, n, offs = gguf.GGUFValueType(int(itype[0])), int(count[0]), orig_offs + 12
            if sub == string:
                buf = memoryview(self.data)
                for _ in range(n):
                    offs += 8 + struct.unpack_from("<Q", buf, offs)[0]
            elif sub in self.gguf_scalar_to_np:
                offs += n * np.dtype(self.gguf_scalar_to_np[sub]).itemsize
            else:  # arrays of arrays: the reader's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            if offs > self.data.shape[0]:
                raise ValueError("a metadata array runs past the end of the file")
            return offs - orig_offs, [itype, count, self.data[orig_offs + 12 : offs]], [2], [array, sub]

    return Lean(path, "r")


def _field(reader: GGUFReader, key: str, default: int | None = None) -> int:
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise SpecheadError(f"the GGUF file lacks {key!r}")
        return default
    return int(f.contents())


def read_gguf_weights(path: Path) -> GGUFWeights:
    """Every weight of a Llama or Gemma 3 GGUF file, memory-mapped and decoded tensor by tensor (see the module)."""
    import gguf

    path = Path(path)
    try:
        try:
            reader = _lean_reader(path)
        except Exception:  # a gguf release whose internals differ (or a bad file): the reader's own parse decides
            reader = gguf.GGUFReader(path, "r")
        arch = str(reader.fields["general.architecture"].contents())
    except Exception as e:  # the parser fails in many ways on bad bytes; all mean the same to the user
        why = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else f"corrupt or truncated ({e})"
        raise SpecheadError(f"cannot read GGUF file {path}: {why}") from e
    if arch not in ARCHS:
        raise SpecheadError(f"GGUF file {path} holds a {arch!r} model; supported: {', '.join(ARCHS)}")
    heads: dict[str, int] = {}
    if arch == "llama":  # llama.cpp permutes q / k rows only for this architecture
        n_head = _field(reader, "llama.attention.head_count")
        heads = {"attn_q": n_head, "attn_k": _field(reader, "llama.attention.head_count_kv", n_head)}
    data = reader.data
    out = GGUFWeights(arch=arch)
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        type_name = t.tensor_type.name
        dims = [int(d) for d in t.shape]  # ggml order: dims[0] is the contiguous K
        if t.data_offset + t.n_bytes > data.shape[0]:
            raise SpecheadError(f"GGUF file {path} is truncated: tensor {t.name} runs past its end")
        raw = data[t.data_offset : t.data_offset + t.n_bytes]
        if len(dims) == 1:
            w = torch.tensor(np.array(gguf.quants.dequantize(raw.reshape(1, -1), t.tensor_type), np.float32)[0])
            if arch == "gemma3" and t.name.endswith("norm.weight"):
                w = w - 1.0  # llama.cpp stores Gemma's norms as 1 + w; HF (and RMSNorm's unit_offset) holds w
            out.tensors[name] = w
            continue
        if len(dims) != 2:
            raise SpecheadError(f"GGUF tensor {t.name} has {len(dims)} dimensions; only matrices and vectors load")
        k, n = dims
        if k % BLOCK:
            raise SpecheadError(f"GGUF tensor {t.name} has rows of {k} values, not a multiple of {BLOCK}")
        raw = raw.reshape(n, -1)
        if type_name in EXACT:
            blocks = decode_blocks(raw, type_name, k)
        else:
            blocks, err = requantize_blocks(raw, t.tensor_type, k)
            out.requantized[name] = (type_name, err)
        kind = t.name.rsplit(".", 2)[-2]
        if kind in heads:
            blocks = blocks.rows(unpermute_rows(n, heads[kind]))
        out.tensors[name] = blocks
    return out
