"""A compact Llama-family decoder in the style of gpt-fast.

One module tree whose parameter names match Hugging Face's ``LlamaForCausalLM``, so a safetensors
checkpoint loads with ``load_state_dict`` and no renaming. What it adds over transformers is what
speculative decoding needs: a preallocated KV cache addressed by slot, an explicit boolean
attention mask (tree verification), compaction of the cache to the accepted path, and the hidden
states EAGLE drafters consume (final normed state, and the inputs of three layers for EAGLE-3).
The building blocks (``Attention``, ``MLP``, ``Block``) are reused by the drafters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spechead import kernels
from spechead.kernels.linear import Projection
from spechead.kernels.qlinear import QuantLinear
from spechead.model.config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm; with ``unit_offset`` (Gemma) the stored weight w scales by (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def fold_offset(self) -> None:
        """Inference only, fp32: store (1 + w) so a call is one plain RMSNorm (the state dict then holds 1 + w).
        A bf16 norm keeps its offset: Gemma computes (1 + w) in fp32 and rounds once, at the end."""
        if self.unit_offset and self.weight.dtype == torch.float32:
            with torch.no_grad():
                self.weight = nn.Parameter((self.weight.float() + 1.0).to(self.weight.dtype), requires_grad=False)
            self.unit_offset = False

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if self.unit_offset:
            if x.dtype != torch.float32:  # Gemma scales in fp32, then casts
                xf = x.float()
                xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                return (xf * (1.0 + w.float())).to(x.dtype)
            w = w + 1.0
        if x.dtype == torch.float32:  # a decode step runs 61 of these
            if kernel_rows(x) and not _needs_grad(w):
                return kernels.ops().rms_norm(x.contiguous(), w, self.eps)  # one pass, not 6 ops
            return F.rms_norm(x, w.shape, w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Token embedding times a constant (sqrt(d) in Gemma, 1 elsewhere), the constant in the table's dtype;
    the LM head tied to it uses the unscaled table."""

    def __init__(self, num: int, dim: int, scale: float = 1.0) -> None:
        # an empty table, not a random one: every model loads its own, and nn.Embedding's normal_ init on the meta
        # device imports torch._dynamo (2.2 s of a process's start)
        super().__init__(num, dim, _weight=torch.empty(num, dim))
        self.scale = scale

    def forward(self, ids: Tensor) -> Tensor:
        x = super().forward(ids)
        return x if self.scale == 1.0 else x * torch.tensor(self.scale, dtype=x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose calls say whether they are part of a prompt's prefill, as the kernel's ``Projection``
    (which ``Transformer.prepack`` swaps in) takes them; the plain product is the same either way."""

    def forward(self, x: Tensor, prefill: bool = False) -> Tensor:
        return super().forward(x)


def _needs_grad(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def kernel_rows(x: Tensor) -> bool:
    """fp32 CPU rows outside autograd, where a kernel build runs."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and not _needs_grad(x)
        and kernels.available()
    )


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies, with Llama-3.1's frequency-dependent scaling when configured."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old_len / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv.float()


class Rotary(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (tree nodes share depth positions)."""

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(head_dim, theta, scaling))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., D] rotated by the positions' cos / sin [..., D] (broadcast over heads)."""
    if x.dim() == 3 and cos.dim() == 3 and x.dtype == torch.float32 and x.device.type == "cpu":
        if not _needs_grad(x, cos, sin) and kernels.available():  # one pass instead of seven ops (a step runs 30)
            return kernels.ops().rope(x.contiguous(), cos[:, 0].contiguous(), sin[:, 0].contiguous())
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class KVCache(nn.Module):
    """Preallocated per-layer key/value buffers [lanes, kv_heads, max_len, head_dim], addressed by slot; one lane
    per request decoded at once (a batch-1 decoder has one). ``storage``: the [2, lanes, kv_heads, max_len,
    head_dim] part of a buffer shared by a model's layers (``Transformer.setup_cache``) to hold them in."""

    def __init__(
        self,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        lanes: int = 1,
        storage: Tensor | None = None,
    ) -> None:
        super().__init__()
        shape = (2, lanes, kv_heads, max_len, head_dim)
        if storage is None:
            storage = torch.zeros(shape, dtype=dtype, device=device)
        elif storage.shape != shape or not storage.is_contiguous():
            raise ValueError(f"a KV cache's storage must be a contiguous {list(shape)} tensor")
        self.register_buffer("k", storage[0], persistent=False)
        self.register_buffer("v", storage[1], persistent=False)

    @property
    def lanes(self) -> int:
        return self.k.shape[0]

    def write(self, start: int, k: Tensor, v: Tensor, lane: int = 0) -> tuple[Tensor, Tensor]:
        """Store k/v [1, kv_heads, T, head_dim] at slots [start, start+T) of ``lane`` and return that lane's
        keys/values of slots [0, start+T) (a [1, ...] view: what a batch-1 call reads, whatever the lane)."""
        end = start + k.shape[2]
        self.k[lane : lane + 1, :, start:end] = k
        self.v[lane : lane + 1, :, start:end] = v
        return self.k[lane : lane + 1, :, :end], self.v[lane : lane + 1, :, :end]


@dataclass(frozen=True)
class Segment:
    """One request's rows in a batched forward: rows [row0, row0 + t) of the packed input, at slots
    [start, start + t) of cache lane ``lane``, with the mask a batch-1 call would pass (bool [t, start + t],
    None: causal) and, in a sliding-window layer, the first slot it reads (``mask`` then starts there).
    Attention runs once per segment exactly as in a batch-1 call, so a request's rows do not depend on what
    else is in the batch; the projections run on every segment's rows at once."""

    row0: int
    t: int
    start: int
    mask: Tensor | None = None
    lane: int = 0
    kv_from: int = 0


def as_segments(
    start: int | Sequence[Segment], t: int, mask: Tensor | None = None, kv_from: int = 0
) -> Sequence[Segment]:
    """The segments of a forward's ``t`` rows: ``start`` as given where it already is a list, else one request's
    rows at slot ``start`` on lane 0 under ``mask``."""
    return [Segment(0, t, start, mask, 0, kv_from)] if isinstance(start, int) else start


def is_prefill(start: int | Sequence[Segment]) -> bool:
    """Whether rows at ``start`` (a slot, or a batched call's segments) are a prompt's prefill: every request's
    rows start at slot 0. A decode step, a verification or a draft continues a cache."""
    return start == 0 if isinstance(start, int) else all(s.start == 0 for s in start)


KERNEL_ROWS = 128  # query rows a request may have for the kernel's attention (past it: a prefill, on SDPA)


class Attention(nn.Module):
    """Grouped-query attention; ``in_features`` differs from the model width in EAGLE-3's drafter. With
    ``qk_norm`` (Gemma 3) each query and key head is RMS-normed before RoPE."""

    def __init__(self, cfg: ModelConfig, in_features: int | None = None) -> None:
        super().__init__()
        d_in = in_features or cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.attn_scale
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.q_proj = Linear(d_in, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(d_in, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(d_in, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.cache: KVCache | None = None

    def fuse(self) -> None:
        """Inference only: one [q; k; v] matrix, so a decode step makes one GEMV instead of three."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = None if self.q_proj.bias is None else torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        self.qkv_proj = Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        self.qkv_proj.weight = nn.Parameter(w, requires_grad=False)
        if b is not None:
            self.qkv_proj.bias = nn.Parameter(b, requires_grad=False)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        start: int | Sequence[Segment],
        mask: Tensor | None = None,
        kv_from: int = 0,
        prefill: bool = False,
    ) -> Tensor:
        """x: [T, d_in] for slots [start, start+T). mask: bool [T, start+T] (True = attend) or None (causal).
        ``kv_from``: a sliding-window layer reads only slots [kv_from, start+T) (``mask`` then has that width).
        ``start`` may instead be the segments of a batched forward (each with its own slots, mask and lane).
        ``prefill``: the rows are a prompt's prefill (``is_prefill``), which the projections' path depends on."""
        t, hd = x.shape[0], self.head_dim
        segments = as_segments(start, t, mask, kv_from)
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x, prefill).split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x, prefill), self.k_proj(x, prefill), self.v_proj(x, prefill)
        if hasattr(self, "q_norm"):
            q = self.q_norm(q.reshape(t * self.n_heads, hd)).view(t, -1)
            k = self.k_norm(k.reshape(t * self.n_kv, hd)).view(t, -1)
        if self._kernel_attends(x, segments):
            op = kernels.ops().attend
            kc, vc, scale = self.cache.k, self.cache.v, self.scale or hd**-0.5
            outs = [
                op(q[r], k[r], v[r], cos[r], sin[r], kc, vc, s.lane, s.start, bool_mask(s.mask), s.kv_from, scale)
                for s in segments
                for r in [slice(s.row0, s.row0 + s.t)]
            ]
            return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs), prefill)
        qk = apply_rope(torch.cat([q, k], dim=-1).view(t, self.n_heads + self.n_kv, hd), cos[:, None], sin[:, None])
        q, k = qk.transpose(0, 1).split([self.n_heads, self.n_kv], dim=0)
        k, v = k.unsqueeze(0), v.view(t, self.n_kv, hd).transpose(0, 1).unsqueeze(0)
        outs = [self._attend(q, k, v, s) for s in segments]
        return self.o_proj(outs[0] if len(outs) == 1 else torch.cat(outs), prefill)

    def _kernel_attends(self, x: Tensor, segments: Sequence[Segment]) -> bool:
        """Decode steps, verifications and drafting (up to ``KERNEL_ROWS`` rows a request) take the kernel's
        attention, which computes each row from its visible slots alone (bitwise the same in a step and in a
        verification); long prefills, training and non-fp32 models take SDPA."""
        cache = self.cache
        return (
            cache is not None
            and cache.k.dtype == torch.float32
            and all(s.t <= KERNEL_ROWS for s in segments)
            and kernel_rows(x)
        )

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, seg: Segment) -> Tensor:
        """Attention of one segment's queries over its lane: [t, n_heads * head_dim]."""
        rows = slice(seg.row0, seg.row0 + seg.t)
        if q.shape[1] != seg.t:
            q, k, v = q[:, rows], k[:, :, rows], v[:, :, rows]
        if self.cache is not None:
            k, v = self.cache.write(seg.start, k, v, seg.lane)
        elif seg.start:
            raise RuntimeError("attention without a cache cannot continue from a prefix")
        if seg.kv_from:
            k, v = k[:, :, seg.kv_from :], v[:, :, seg.kv_from :]
        mask, causal = seg.mask, False
        if mask is None and seg.t > 1:
            # a prompt from slot 0: SDPA's own causal form, which skips the blocks above the diagonal and gives
            # the mask's values; a continuation needs the mask aligned to its last rows
            causal = k.shape[2] == seg.t
            mask = None if causal else causal_mask(seg.t, k.shape[2], q.device)
        gqa, scale = self.n_kv != self.n_heads, self.scale
        q = q.unsqueeze(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, scale=scale)
        return out[0].transpose(0, 1).reshape(seg.t, -1)


def bool_mask(mask: Tensor | None) -> Tensor | None:
    """A mask as the kernels take it: contiguous bool (None: causal)."""
    return None if mask is None else mask.to(torch.bool).contiguous()


def causal_mask(t: int, total: int, device: torch.device) -> Tensor:
    """Bool [t, total]: query i (at slot total-t+i) sees every slot up to its own."""
    return torch.ones(t, total, dtype=torch.bool, device=device).tril(total - t)


class MLP(nn.Module):
    """Gated MLP: SwiGLU (Llama) or GeGLU with the tanh GELU (Gemma)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def fuse(self) -> None:
        """Inference only: one [gate; up] matrix (one GEMV instead of two per decode step)."""
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_up_proj = Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.gate_up_proj.weight = nn.Parameter(w, requires_grad=False)
        del self.gate_proj, self.up_proj

    def act(self, gate: Tensor) -> Tensor:
        return F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)

    def forward(self, x: Tensor, prefill: bool = False) -> Tensor:
        if hasattr(self, "gate_up_proj"):
            gate_up = self.gate_up_proj(x, prefill)
            if not self.gelu and kernel_rows(gate_up):  # one pass, and what the fused decoder layer computes
                return self.down_proj(kernels.ops().silu_mul(gate_up), prefill)
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up, prefill)
        return self.down_proj(self.act(self.gate_proj(x, prefill)) * self.up_proj(x, prefill), prefill)


class Block(nn.Module):
    """Residual attention + gated-MLP block. The caller chooses what attention reads (``attn_input``).

    Llama: ``post_attention_layernorm`` is the MLP's input norm. Gemma 3 (``sandwich_norms``): it norms the
    attention output before the residual add, and ``pre_/post_feedforward_layernorm`` wrap the MLP."""

    def __init__(self, cfg: ModelConfig, attn_in: int | None = None, input_norm: bool = True) -> None:
        super().__init__()
        d, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        if input_norm:
            self.input_layernorm = RMSNorm(d, eps, off)
        self.self_attn = Attention(cfg, attn_in)
        self.post_attention_layernorm = RMSNorm(d, eps, off)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, off)
            self.post_feedforward_layernorm = RMSNorm(d, eps, off)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: Tensor,
        attn_input: Tensor,
        cos: Tensor,
        sin: Tensor,
        start: int | Sequence[Segment],
        mask: Tensor | None = None,
        kv_from: int = 0,
        prefill: bool = False,
    ) -> Tensor:
        a = self.self_attn(attn_input, cos, sin, start, mask, kv_from, prefill)
        if self.sandwich:
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h), prefill))
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h), prefill)


def fused_stack(blocks: Sequence[Block], cfg: ModelConfig, local: Sequence[bool]) -> tuple:
    """The weight arguments of the kernels' ``decoder_layers`` for ``blocks``: per block its six norms (an empty
    tensor for one it lacks: EAGLE-2's layer has no input norm, Llama's no sandwich or head norms), cache and
    blocked projections in one list, then the tensors a weight is, eps, the projections' widths, whether the MLP is
    GeGLU, which blocks are local and the softmax scale. () where a block is not one the op runs: biases, another
    activation, projections not fused or not on the kernel, no cache."""
    if cfg.attention_bias or cfg.hidden_act not in ("silu", "gelu_pytorch_tanh"):
        return ()
    none = torch.empty(0)
    layers: list[Tensor] = []
    kinds, eps = set(), set()
    for block in blocks:
        a, m = block.self_attn, block.mlp
        lin = [getattr(a, "qkv_proj", None), a.o_proj, getattr(m, "gate_up_proj", None), m.down_proj]
        if not all(isinstance(li, (Projection, QuantLinear)) for li in lin) or a.cache is None:
            return ()
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm")
        norms = [getattr(block, n, None) for n in (*names, "post_feedforward_layernorm")]
        norms += [getattr(a, "q_norm", None), getattr(a, "k_norm", None)]
        if any(n is not None and n.unit_offset for n in norms):
            return ()
        weights = [li.layout.tensors if isinstance(li, QuantLinear) else [li.layout.data] for li in lin]
        kinds.add(tuple(len(w) for w in weights))
        eps.update(n.eps for n in norms if n is not None)
        layers += [none if n is None else n.weight for n in norms] + [a.cache.k, a.cache.v]
        layers += [t for w in weights for t in w]
    if len(kinds) != 1 or len(set(next(iter(kinds)))) != 1 or len(eps) != 1:
        return ()  # one op takes one kind of weight and one eps for every layer
    a, mlp = blocks[0].self_attn, blocks[0].mlp
    widths = [a.qkv_proj.out_features, a.o_proj.out_features, mlp.gate_up_proj.out_features]
    widths.append(mlp.down_proj.out_features)
    flags = [int(flag) for flag in local]
    return layers, next(iter(kinds))[0], eps.pop(), widths, mlp.gelu, flags, a.scale or cfg.head_dim**-0.5


def fused_args(
    blocks: Sequence[Block],
    stack: tuple,
    x: Tensor,
    segments: Sequence[Segment],
    rope: tuple[Tensor, Tensor],
    local_segments: Sequence[Segment] = (),
    local_rope: tuple[Tensor, Tensor] | None = None,
) -> tuple | None:
    """The arguments (after ``x``, before ``keep``) of ``decoder_layers`` over ``blocks`` (their ``fused_stack``)
    where it computes what the modules would: rows its projections and attention take the kernel for
    (``local_segments`` and ``local_rope``: the sliding-window layers' view, where there are any). One op for every
    layer instead of ~25 Python-level calls a layer; None otherwise."""
    qkv = getattr(blocks[0].self_attn, "qkv_proj", None)
    if (
        not stack
        or not isinstance(qkv, (Projection, QuantLinear))
        or not qkv.on_kernel(x, is_prefill(segments))
        or any(s.t > KERNEL_ROWS for s in segments)
        or not kernel_rows(x)
    ):
        return None
    layers, per_weight, eps, widths, gelu, local, scale = stack
    local_segments = local_segments or segments
    local_rope = local_rope or rope
    rows = (
        [s.row0 for s in segments],
        [s.t for s in segments],
        [s.lane for s in segments],
        [s.start for s in segments],
        [bool_mask(s.mask) for s in segments],
        [s.kv_from for s in segments],
        [bool_mask(s.mask) for s in local_segments],
        [s.kv_from for s in local_segments],
    )
    return (layers, per_weight, eps, widths, gelu, local, *rope, *local_rope, *rows, scale)
