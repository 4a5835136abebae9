"""A decoder's configuration, read from a transformers ``config.json``.

One configuration describes the Llama family (Llama, SmolLM, Qwen2) and Gemma 3's text decoder: the
fields below the first block say where Gemma 3 differs, so one model implementation serves both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from spechead.errors import SpecheadError

GEMMA3_TYPES = ("gemma3_text",)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0  # the global (full-attention) layers' base
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # Gemma 3 (defaults are the Llama family's)
    hidden_act: str = "silu"  # the MLP gate: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (sqrt(d) in Gemma)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w) instead of w
    sandwich_norms: bool = False  # norms after attention and MLP too (pre_/post_feedforward_layernorm)
    qk_norm: bool = False  # RMSNorm over each query / key head before RoPE
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    sliding_window: int | None = None  # keys a local layer sees, its own position included
    layer_types: list[str] | None = None  # per layer: "full_attention" or "sliding_attention"
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers
    rope_local_scaling: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def block_macs(self) -> int:
        """Multiply-adds per token of the decoder blocks' projections (attention scores, the embedding and the
        LM head excluded): what a prompt row costs before the head, to weigh the head's work against."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        d = self.hidden_size
        return self.num_hidden_layers * (d * (2 * q + 2 * kv) + 3 * d * self.intermediate_size)

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` attends through the sliding window."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a transformers ``config.json`` dict (Llama / Qwen2-style keys, old and new rope keys, and
        Gemma 3's text config, whose ``rope_parameters`` may hold one entry per layer type)."""
        heads = d["num_attention_heads"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        local_rope: dict[str, Any] = {}
        if "full_attention" in rope or "sliding_attention" in rope:  # one set per layer type
            local_rope, rope = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
        theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = d.get("model_type")
        gemma = kind in GEMMA3_TYPES
        if kind in ("gemma", "gemma2", "gemma3", "gemma3n"):
            raise SpecheadError(f"unsupported model type {kind!r}: spechead runs Gemma 3's text decoder (gemma3_text)")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if d.get(key) is not None:
                raise SpecheadError(f"unsupported model: {key} = {d[key]} (Gemma 2's soft-capping is not implemented)")
        if d.get("use_bidirectional_attention"):
            raise SpecheadError("unsupported model: bidirectional attention (an encoder, not a decoder)")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        layer_types = _layer_types(d, gemma)
        act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise SpecheadError(f"unsupported MLP activation {act!r} (expected silu or gelu_pytorch_tanh)")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=_scaling(rope),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            hidden_act=act,
            embed_scale=math.sqrt(d["hidden_size"]) if gemma else 1.0,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            qk_norm=gemma,
            attn_scale=d["query_pre_attn_scalar"] ** -0.5 if gemma and d.get("query_pre_attn_scalar") else None,
            sliding_window=d.get("sliding_window") if layer_types else None,
            layer_types=layer_types,
            rope_local_theta=float(local_rope.get("rope_theta", d.get("rope_local_base_freq", theta)))
            if layer_types
            else None,
            rope_local_scaling=_scaling(local_rope) if local_rope else _scaling(rope) if layer_types else None,
            extra=d,
        )


def _layer_types(d: dict[str, Any], gemma: bool) -> list[str] | None:
    """Per-layer attention kinds when the model has sliding-window layers, else None. Older Gemma 3 configs give
    only ``sliding_window_pattern`` (every N-th layer global), as transformers reads them."""
    n = d["num_hidden_layers"]
    if not d.get("sliding_window"):
        return None
    types = d.get("layer_types")
    if types is None and gemma:
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if types is None:
        if d.get("use_sliding_window"):
            raise SpecheadError("unsupported model: a sliding window without per-layer layer_types")
        return None  # e.g. Qwen2 configs name a window they do not use
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise SpecheadError(f"layer_types must list {n} of {', '.join(LAYER_TYPES)}, got {types}")
    return list(types) if "sliding_attention" in types else None


def _scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    return rope if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) else None
