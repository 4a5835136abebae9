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
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spechead import kernels
from spechead.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # a decode step runs 61 of these
            if x.dim() == 2 and x.device.type == "cpu" and not _needs_grad(x, self.weight) and kernels.available():
                return kernels.ops().rms_norm(x.contiguous(), self.weight, self.eps)  # one pass, not 6 ops
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _needs_grad(*ts: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


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
    """Preallocated per-layer key/value buffers [1, kv_heads, max_len, head_dim], addressed by slot."""

    def __init__(self, max_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        shape = (1, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k/v at slots [start, start+T) and return the keys/values of slots [0, start+T)."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def move(self, src_slots: Tensor, dst_start: int) -> None:
        """Copy slots ``src_slots`` (in order) to the contiguous range starting at ``dst_start``."""
        n = src_slots.numel()
        self.k[:, :, dst_start : dst_start + n] = self.k.index_select(2, src_slots)
        self.v[:, :, dst_start : dst_start + n] = self.v.index_select(2, src_slots)


class Attention(nn.Module):
    """Grouped-query attention; ``in_features`` differs from the model width in EAGLE-3's drafter."""

    def __init__(self, cfg: ModelConfig, in_features: int | None = None) -> None:
        super().__init__()
        d_in = in_features or cfg.hidden_size
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.cache: KVCache | None = None

    def fuse(self) -> None:
        """Inference only: one [q; k; v] matrix, so a decode step makes one GEMV instead of three."""
        w = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = None if self.q_proj.bias is None else torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        self.qkv_proj = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        self.qkv_proj.weight = nn.Parameter(w, requires_grad=False)
        if b is not None:
            self.qkv_proj.bias = nn.Parameter(b, requires_grad=False)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, start: int, mask: Tensor | None) -> Tensor:
        """x: [T, d_in] for slots [start, start+T). mask: bool [T, start+T] (True = attend) or None (causal)."""
        t, hd = x.shape[0], self.head_dim
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qk = apply_rope(torch.cat([q, k], dim=-1).view(t, self.n_heads + self.n_kv, hd), cos[:, None], sin[:, None])
        q, k = qk.transpose(0, 1).split([self.n_heads, self.n_kv], dim=0)
        k, v = k.unsqueeze(0), v.view(t, self.n_kv, hd).transpose(0, 1).unsqueeze(0)
        if self.cache is not None:
            k, v = self.cache.write(start, k, v)
        elif start:
            raise RuntimeError("attention without a cache cannot continue from a prefix")
        if mask is None and t > 1:
            mask = causal_mask(t, k.shape[2], x.device)
        gqa = self.n_kv != self.n_heads
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out[0].transpose(0, 1).reshape(t, -1))


def causal_mask(t: int, total: int, device: torch.device) -> Tensor:
    """Bool [t, total]: query i (at slot total-t+i) sees every slot up to its own."""
    return torch.ones(t, total, dtype=torch.bool, device=device).tril(total - t)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def fuse(self) -> None:
        """Inference only: one [gate; up] matrix (one GEMV instead of two per decode step)."""
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_up_proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        self.gate_up_proj.weight = nn.Parameter(w, requires_grad=False)
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Residual attention + SwiGLU block. The caller chooses what attention reads (``attn_input``)."""

    def __init__(self, cfg: ModelConfig, attn_in: int | None = None, input_norm: bool = True) -> None:
        super().__init__()
        if input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, attn_in)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: Tensor, attn_input: Tensor, cos: Tensor, sin: Tensor, start: int, mask: Tensor | None
    ) -> Tensor:
        h = x + self.self_attn(attn_input, cos, sin, start, mask)
        return h + self.mlp(self.post_attention_layernorm(h))
