"""Drafter training: EAGLE-1/2 and EAGLE-3 objectives over cached target features, SlimSpec heads.

Both architectures train with one loop, the *training-time test* (TTT) unroll of EAGLE-3: step 0
feeds the cached target feature f_t and token x_{t+1} at position t and predicts x_{t+2}; step i
feeds the drafter's own step-(i-1) output and x_{t+1+i} at position t+i, attending to the real
prefix (step-0 keys up to t) plus its own chain (the diagonal keys of steps 1..i), exactly what
tree drafting shows it at inference. Losses:

* EAGLE-1/2 (``--arch eagle2``, default 1 step): SmoothL1 regression of the predicted feature on
  f_{t+1+i} plus ``ce_weight`` x soft cross-entropy of the target's head on it against the
  target's own distribution (computed from the cached f through the frozen head).
* EAGLE-3 (``--arch eagle3``, default 7 steps): soft cross-entropy against the target's
  distribution at each step, weighted 0.8^i.

The vocabulary-wide cross-entropy dominates the cost (V = 49152 on the demo target against a
576-wide drafter), so it is computed on ``ce_positions`` random valid positions per step; the
regression term is cheap and uses every position. Everything is seeded per step, so a resumed
run retraces the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.model.drafter import Drafter, Eagle3Drafter
from spechead.model.layers import apply_rope
from spechead.model.transformer import Transformer
from spechead.training.config import TrainConfig
from spechead.training.features import Chunk, block_causal_mask, packed_positions


def draft_logits(drafter: Drafter, target: Transformer, x: Tensor) -> Tensor:
    """Logits of the drafter's head over the target vocabulary for head inputs x [n, d]."""
    lr = drafter.low_rank_head if isinstance(drafter, Eagle3Drafter) else None
    if lr is not None:
        return lr(x)
    w, row_ids = drafter.head_weight(target)
    if row_ids is not None:
        raise SpecheadError("training a drafter with a reduced draft vocabulary is not supported")
    return x @ w.T.to(x.dtype)


# -- the training-time-test unroll ---------------------------------------------------------------------
def _ttt_attention(attn, x: Tensor, cos: Tensor, sin: Tensor, mask0: Tensor, past: list[tuple[Tensor, Tensor]]):
    """Attention of step i = len(past): step-0 keys under ``mask0`` plus the diagonal keys of steps 1..i."""
    t, hd = x.shape[0], attn.head_dim
    q = attn.q_proj(x).view(t, attn.n_heads, hd).transpose(0, 1)
    k = attn.k_proj(x).view(t, attn.n_kv, hd).transpose(0, 1)
    v = attn.v_proj(x).view(t, attn.n_kv, hd).transpose(0, 1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    past.append((k, v))
    rep = attn.n_heads // attn.n_kv
    if len(past) == 1:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask0, enable_gqa=rep > 1)[0]
    else:
        scale = hd**-0.5
        k0, v0 = (z.repeat_interleave(rep, 0) for z in past[0])
        s0 = (q @ k0.transpose(1, 2) * scale).masked_fill(~mask0, float("-inf"))  # [H, T, T]
        ks = torch.stack([z[0].repeat_interleave(rep, 0) for z in past[1:]], dim=2)  # [H, T, i, hd]
        vs = torch.stack([z[1].repeat_interleave(rep, 0) for z in past[1:]], dim=2)
        sd = (q[:, :, None] * ks).sum(-1) * scale  # [H, T, i]
        p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
        out = p[..., :t] @ v0 + (p[..., t:, None] * vs).sum(2)
    return attn.o_proj(out.transpose(0, 1).reshape(t, -1))


def _layer_input(drafter: Drafter, tokens: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """(residual, attention input) for a drafter step, as in the drafter's own forward."""
    if isinstance(drafter, Eagle3Drafter):
        if h.shape[-1] != drafter.config.hidden_size:
            h = drafter.fc(h)
        layer = drafter.midlayer
        return h, torch.cat([layer.input_layernorm(drafter.embed(tokens)), layer.hidden_norm(h)], dim=-1)
    x = drafter.fc(torch.cat([drafter.embed(tokens), h], dim=-1))
    return x, x


@dataclass
class Batch:
    """A pack of examples: per token ids, loss mask, example end (exclusive), features."""

    ids: Tensor
    mask: Tensor
    end: Tensor
    lengths: list[int]
    hidden: Tensor
    aux: Tensor | None

    def to(self, device: torch.device | str) -> Batch:
        """The pack's states on ``device`` (a no-op for what is there already, as online chunks' states are).
        Token ids, loss mask and ends stay on the host: ``run_ttt`` plans its indices there, so that an unroll on
        a GPU need not wait for the device to learn how many positions a step has (it reads the device once a pack)."""
        aux = self.aux.to(device, non_blocking=True) if self.aux is not None else None
        return Batch(self.ids, self.mask, self.end, self.lengths, self.hidden.to(device, non_blocking=True), aux)


def make_batch(chunk: Chunk, lo: int, hi: int) -> Batch:
    sl = slice(int(chunk.starts[lo]), int(chunk.starts[hi]))
    starts = chunk.starts[lo : hi + 1] - chunk.starts[lo]
    lengths = (starts[1:] - starts[:-1]).tolist()
    end = torch.repeat_interleave(starts[1:], torch.tensor(lengths))
    aux = chunk.aux[sl] if chunk.aux is not None else None
    return Batch(chunk.ids[sl], chunk.mask[sl], end, lengths, chunk.hidden[sl], aux)


@dataclass
class StepOut:
    loss: Tensor
    ce: list[float]
    top1: list[tuple[int, int]]  # (agreements, positions) per step
    topk: list[tuple[int, int]]
    tokens: int


def run_ttt(
    drafter: Drafter,
    target: Transformer,
    b: Batch,
    cfg: TrainConfig,
    gen: torch.Generator,
    teacher: Tensor | None = None,
    ce_positions: int | None = None,
    states: list[Tensor] | None = None,
) -> StepOut:
    """The loss of one pack, unrolled over ``cfg.n_steps`` steps (see the module docstring). Runs on the pack's
    device; ``gen`` is a CPU generator, so a seeded step draws the same noise and positions on any device."""
    n = b.ids.numel()
    dev = b.hidden.device
    ids, end, lmask = b.ids.cpu(), b.end.cpu(), b.mask.cpu()
    idx = torch.arange(n)
    mask0 = block_causal_mask(b.lengths, dev)
    pos0 = packed_positions(b.lengths, dev)
    hidden = b.hidden.float()
    w_t = target.lm_head.weight
    eagle3 = isinstance(drafter, Eagle3Drafter)
    if eagle3:
        if b.aux is None:
            raise SpecheadError("these features have no EAGLE-3 layer states; extract them with --arch eagle3")
        h = b.aux.float()
    else:
        h = hidden
        if cfg.noise > 0 and drafter.training:
            rms = h.pow(2).mean(-1, keepdim=True).sqrt()
            h = h + (torch.rand(h.shape, generator=gen).to(dev, non_blocking=True) * 2 - 1) * cfg.noise * rms
    layer, past = drafter.layer, []
    total = torch.zeros((), device=dev)
    stats: list[Tensor] = []  # per step: top-1 hits, top-k hits, cross-entropy (read once, at the end)
    counts: list[int] = []
    n_ce = ce_positions or cfg.ce_positions
    frozen = cfg.freeze_backbone
    for i in range(cfg.n_steps):
        src = idx + 1 + i  # input token index
        tgt = idx + 2 + i  # predicted token index
        tok = ids[src.clamp_max(n - 1)].to(dev, non_blocking=True)
        valid = (tgt < end) & (lmask[tgt.clamp_max(n - 1)] | (cfg.all_positions and drafter.training))
        cos, sin = drafter.rotary(pos0 + i)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            resid, x = _layer_input(drafter, tok, h)
            out = resid + _ttt_attention(layer.self_attn, x, cos, sin, mask0, past)
            out = out + layer.mlp(layer.post_attention_layernorm(out))
        if states is not None:
            states.append(out)
        rows = valid.nonzero().flatten()
        weight = cfg.step_decay**i
        if rows.numel():
            if not eagle3:  # feature regression on every valid position
                at = rows.to(dev, non_blocking=True)
                reg = F.smooth_l1_loss(out[at], hidden[src[rows].to(dev, non_blocking=True)])
                total = total + weight * reg
            pick_h = rows[torch.randperm(rows.numel(), generator=gen)[:n_ce]]
            pick = pick_h.to(dev, non_blocking=True)
            head_in = drafter.head_input(out[pick])
            logits = draft_logits(drafter, target, head_in).float()
            with torch.no_grad():
                feat_next = hidden[src[pick_h].to(dev, non_blocking=True)]
                t_logits = (head_in.detach() @ teacher.T) if teacher is not None else feat_next @ w_t.T
                p = torch.softmax(t_logits.float(), -1)
            ce = -(p * torch.log_softmax(logits, -1)).sum(-1).mean()
            total = total + weight * (cfg.ce_weight if not eagle3 and teacher is None else 1.0) * ce
            with torch.no_grad():
                ref = p.argmax(-1)
                kk = logits.topk(min(cfg.topk, logits.shape[-1]), -1).indices
                hits1 = (logits.argmax(-1) == ref).sum()
                stats.append(torch.stack([hits1.double(), (kk == ref[:, None]).any(-1).sum().double(), ce.double()]))
            counts.append(int(pick_h.numel()))
        else:
            stats.append(torch.tensor([0.0, 0.0, float("nan")], dtype=torch.float64).to(dev, non_blocking=True))
            counts.append(0)
        h = out
    got = torch.stack(stats).tolist()  # the one wait for the device, after the whole unroll is queued
    top1 = [(int(s[0]), c) for s, c in zip(got, counts, strict=True)]
    topk = [(int(s[1]), c) for s, c in zip(got, counts, strict=True)]
    return StepOut(total, [s[2] for s in got], top1, topk, n)
