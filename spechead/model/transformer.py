"""The target / drafter decoder stack with its KV cache and an explicit LM-head seam."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from spechead import kernels
from spechead.kernels.linear import prepack_linears
from spechead.model.config import ModelConfig
from spechead.model.layers import (
    Block,
    KVCache,
    RMSNorm,
    Rotary,
    ScaledEmbedding,
    Segment,
    causal_mask,
    fused_args,
    fused_stack,
    is_prefill,
)


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


@dataclass
class BatchPart:
    """One request's rows in ``Transformer.forward_batch``: ``forward``'s arguments plus the request's cache lane."""

    tokens: Tensor  # [T]
    start: int
    lane: int = 0
    positions: Tensor | None = None
    mask: Tensor | None = None
    logits_rows: slice | Tensor | None = field(default_factory=lambda: slice(None))  # as in forward


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
        self.max_len, self.lanes = 0, 0
        self.precision = "fp32"  # what its projections compute in: fp32, bf16 (float weights), gguf, q8, q4
        self._fused: tuple | None = None  # decoder_layers' weight arguments, built at the first forward
        self._kv: Tensor | None = None  # [layers, 2, lanes, kv_heads, max_len, head_dim]: every layer's cache

    def setup_cache(self, max_len: int, lanes: int = 1) -> None:
        """Allocate the KV cache (and RoPE tables) for ``lanes`` sequences of up to ``max_len`` tokens each (one
        lane per request a batched decoder holds at once)."""
        cfg, p = self.config, self.model.norm.weight  # fp32 or the float dtype, at every precision
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's context of {cfg.max_position_embeddings}")
        if max_len == self.max_len and lanes <= self.lanes:  # lanes only grow: batch-1 decoders use lane 0
            return
        self.max_len, self.lanes = max_len, max(lanes, self.lanes)
        self._fused = None
        self.rotary = Rotary(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling).to(p.device)
        if any(self.local):
            theta, scaling = cfg.rope_local_theta, cfg.rope_local_scaling
            self.local_rotary = Rotary(cfg.head_dim, max_len, theta, scaling).to(p.device)
        kv = (max_len, cfg.num_key_value_heads, cfg.head_dim, p.dtype, p.device, self.lanes)
        # every layer's keys and values in one buffer, so that move_cache moves an accepted path in one copy
        shape = (len(self.model.layers), 2, self.lanes, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self._kv = torch.zeros(shape, dtype=p.dtype, device=p.device)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.cache = KVCache(*kv, storage=self._kv[i])

    def fuse(self) -> Transformer:
        """Fuse projections (and fold Gemma's 1 + w norms) for inference: the state dict no longer matches the
        HF names afterwards."""
        self._fused = None
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fold_offset()
        return self

    def prepack(self) -> bool:
        """Every projection and the LM head on spechead's kernel where a build runs for their weights
        (``kernels.linear.Projection``); returns whether they are. One layout serves every row count. Idempotent."""
        self._fused = None
        return prepack_linears(self)

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

    def _fused_layers(
        self,
        x: Tensor,
        segments: list[Segment],
        rope: tuple[Tensor, Tensor],
        local_segments: list[Segment],
        local_rope: tuple[Tensor, Tensor] | None,
    ) -> tuple | None:
        """``layers.fused_args`` for this target's layers (their stack built at the first call)."""
        if self._fused is None:
            self._fused = fused_stack(self.model.layers, self.config, self.local)
        return fused_args(self.model.layers, self._fused, x, segments, rope, local_segments, local_rope)

    def move_cache(self, src_slots: Tensor, dst_start: int, lane: int = 0) -> None:
        """Copy slots ``src_slots`` (in order) of ``lane`` to its range from ``dst_start``, in every layer at once
        (one gather and one copy, where a layer at a time took ~1 ms of a demo round on an AMD EPYC Zen 3)."""
        n = src_slots.numel()
        lane_kv = self._kv[:, :, lane]  # [layers, 2, kv_heads, max_len, head_dim]
        lane_kv[:, :, :, dst_start : dst_start + n] = lane_kv.index_select(3, src_slots)

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
        return self.forward_batch([BatchPart(tokens, start, 0, positions, mask, logits_rows)], want_aux)[0]

    def forward_batch(self, parts: list[BatchPart], want_aux: bool = False) -> list[TargetOutput]:
        """Several requests' rows in one forward, each on its own cache lane: every projection (and the LM head)
        runs once over all rows, attention once per request as in ``forward``, so each part's output is what
        ``forward`` would give it alone (bitwise, where the projections' kernel runs: its results do not
        depend on the row count).

        A call whose parts all start at slot 0 is a prompt's prefill (``layers.is_prefill``), and says so to
        every projection (``prefill``): their path then depends on the prompt's length only, so a prompt gives the
        same bits under AR, any tree and any batch (decoders prefill a prompt alone). The LM head takes the kernel
        at any row count, so the last prompt row's logits are AR's however many prompt rows a head asks for."""
        if self.rotary is None:
            raise RuntimeError("call setup_cache() before forward()")
        segments, local_segments, positions, row0 = [], [], [], 0
        for p in parts:
            t = p.tokens.shape[0]
            if p.start + t > self.max_len:
                raise ValueError(f"sequence of {p.start + t} tokens exceeds the cache of {self.max_len}")
            if not 0 <= p.lane < self.lanes:
                raise ValueError(f"cache lane {p.lane} out of range: the cache has {self.lanes}")
            pos = torch.arange(p.start, p.start + t, device=p.tokens.device) if p.positions is None else p.positions
            segments.append(Segment(row0, t, p.start, p.mask, p.lane))
            if self.local_rotary is not None:
                kv_from, local_mask = self.window(p.start, pos, p.mask)
                local_segments.append(Segment(row0, t, p.start, local_mask, p.lane, kv_from))
            positions.append(pos)
            row0 += t
        one = len(parts) == 1
        pos = positions[0] if one else torch.cat(positions)
        cos, sin = self.rotary(pos)
        if self.local_rotary is not None:
            local_cos, local_sin = self.local_rotary(pos)
        x = self.model.embed_tokens(parts[0].tokens if one else torch.cat([p.tokens for p in parts]))
        aux: dict[int, Tensor] = {}
        prefill = is_prefill(segments)
        local_rope = (local_cos, local_sin) if self.local_rotary is not None else None
        fused = self._fused_layers(x, segments, (cos, sin), local_segments, local_rope)
        if fused is not None:
            keep = list(self.eagle3_layers) if want_aux else []
            *kept, x = kernels.ops().decoder_layers(x, *fused, keep)
            aux = dict(zip(keep, kept, strict=True))
        else:
            for i, layer in enumerate(self.model.layers):
                if want_aux and i in self.eagle3_layers:
                    aux[i] = x
                if self.local[i]:
                    x = layer(x, layer.input_layernorm(x), local_cos, local_sin, local_segments, prefill=prefill)
                else:
                    x = layer(x, layer.input_layernorm(x), cos, sin, segments, prefill=prefill)
        h = self.model.norm(x)
        fused = torch.cat([aux[i] for i in self.eagle3_layers], dim=-1) if want_aux else None
        if one:
            logits = None if parts[0].logits_rows is None else self.lm_head(h[parts[0].logits_rows])
            return [TargetOutput(h, logits, fused)]
        # the LM head once over every part's selected rows
        picks = [
            torch.arange(s.row0, s.row0 + s.t, device=h.device)[p.logits_rows]
            for s, p in zip(segments, parts, strict=True)
            if p.logits_rows is not None
        ]
        logits = self.lm_head(h[torch.cat(picks)]).split([len(r) for r in picks]) if picks else []
        outs, j = [], 0
        for s, p in zip(segments, parts, strict=True):
            rows = slice(s.row0, s.row0 + s.t)
            part_logits = None
            if p.logits_rows is not None:
                part_logits, j = logits[j], j + 1
            outs.append(TargetOutput(h[rows], part_logits, None if fused is None else fused[rows]))
        return outs
