"""The target / drafter decoder stack with its KV cache and an explicit LM-head seam."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from spechead import kernels
from spechead.kernels.linear import PackedLinear, mkl_packing_available
from spechead.model.config import ModelConfig
from spechead.model.layers import Block, KVCache, RMSNorm, Rotary, ScaledEmbedding, causal_mask


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


@dataclass
class TargetOutput:
    hidden: Tensor  # [T, d] final normed state (EAGLE-1/2 feature, LM-head input)
    logits: Tensor | None  # [T', V] for the requested rows
    aux: Tensor | None = None  # [T, 3d] inputs of layers (2, L//2, L-3) for EAGLE-3


class Transformer(nn.Module):
    """Target model. ``forward`` runs T tokens at slots [start, start+T) of the KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        n = cfg.num_hidden_layers
        # EAGLE-3 fuses the inputs of layers 2, L//2 and L-3 (tiny test models fall back to spread-out layers)
        self.eagle3_layers = (2, n // 2, n - 3) if n >= 6 else (0, n // 2, n - 1)
        self.rotary: Rotary | None = None
        self.local_rotary: Rotary | None = None  # the sliding-window layers' RoPE (Gemma 3), else None
        self.local = [cfg.is_local(i) for i in range(n)]
        self.max_len = 0

    def setup_cache(self, max_len: int) -> None:
        """Allocate the KV cache (and RoPE tables) for sequences of up to ``max_len`` tokens."""
        cfg, p = self.config, self.lm_head.weight
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context of {cfg.max_position_embeddings}")
        if max_len == self.max_len:
            return
        self.max_len = max_len
        self.rotary = Rotary(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling).to(p.device)
        if any(self.local):
            theta, scaling = cfg.rope_local_theta, cfg.rope_local_scaling
            self.local_rotary = Rotary(cfg.head_dim, max_len, theta, scaling).to(p.device)
        for layer in self.model.layers:
            layer.self_attn.cache = KVCache(max_len, cfg.num_key_value_heads, cfg.head_dim, p.dtype, p.device)

    def fuse(self) -> Transformer:
        """Fuse projections (and fold Gemma's 1 + w norms) for inference: the state dict no longer matches the
        HF names afterwards."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fold_offset()
        return self

    def prepack(self, rows: int) -> bool:
        """Lay out every projection for few-row products: spechead's kernels (any row count up to 16) where
        a build runs, else MKL packing at ``rows`` rows (the verification size; fp32 only). Returns whether a
        layout applies. Idempotent; see ``kernels.linear.PackedLinear`` for why."""
        w = self.lm_head.weight
        if w.device.type != "cpu":
            return False
        if not kernels.supports(w) and (rows < 2 or w.dtype != torch.float32 or not mkl_packing_available()):
            return False
        for name, child in list(self.named_modules()):
            if isinstance(child, nn.Linear):
                parent_name, _, attr = name.rpartition(".")
                child = PackedLinear.from_linear(child)
                setattr(self.get_submodule(parent_name), attr, child)
            if isinstance(child, PackedLinear):
                child.pack(rows)
        return True

    def window(self, start: int, positions: Tensor, mask: Tensor | None) -> tuple[int, Tensor | None]:
        """The sliding-window layers' view of slots [0, start+T): (first slot read, mask over the slots read).

        A query at position p sees keys at positions in (p - W, p]. Committed slots hold their own positions
        (the cache is compacted to the accepted path), tree nodes sit at ``start + depth`` and no query is
        before ``start``, so no slot before ``start - W + 1`` is ever seen; within the slots read, the window
        is intersected with the tree / causal mask, so a node at depth k sees exactly the window its
        position implies."""
        w, t = self.config.sliding_window, positions.shape[0]
        kv_from = max(0, start - w + 1)
        if t == 1 and mask is None:
            return kv_from, None  # a decode step: every slot read is inside its window
        dev = positions.device
        base = causal_mask(t, start + t, dev) if mask is None else mask
        key_pos = torch.cat([torch.arange(kv_from, start, device=dev), positions])
        inside = key_pos[None, :] > positions[:, None] - w
        return kv_from, base[:, kv_from:] & inside

    def move_cache(self, src_slots: Tensor, dst_start: int) -> None:
        for layer in self.model.layers:
            layer.self_attn.cache.move(src_slots, dst_start)

    def forward(
        self,
        tokens: Tensor,
        start: int,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
        logits_rows: slice | Tensor | None = slice(None),
        want_aux: bool = False,
    ) -> TargetOutput:
        """tokens: [T] ids for slots [start, start+T). positions default to the slots (tree nodes pass depths).

        ``logits_rows`` selects which rows get the (expensive) LM head: all by default, None for none.
        """
        if self.rotary is None:
            raise RuntimeError("call setup_cache() before forward()")
        t = tokens.shape[0]
        if start + t > self.max_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds the cache of {self.max_len}")
        if positions is None:
            positions = torch.arange(start, start + t, device=tokens.device)
        cos, sin = self.rotary(positions)
        if self.local_rotary is not None:
            local_cos, local_sin = self.local_rotary(positions)
            kv_from, local_mask = self.window(start, positions, mask)
        x = self.model.embed_tokens(tokens)
        aux: dict[int, Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if want_aux and i in self.eagle3_layers:
                aux[i] = x
            if self.local[i]:
                x = layer(x, layer.input_layernorm(x), local_cos, local_sin, start, local_mask, kv_from)
            else:
                x = layer(x, layer.input_layernorm(x), cos, sin, start, mask)
        h = self.model.norm(x)
        logits = None if logits_rows is None else self.lm_head(h[logits_rows])
        fused = torch.cat([aux[i] for i in self.eagle3_layers], dim=-1) if want_aux else None
        return TargetOutput(h, logits, fused)
