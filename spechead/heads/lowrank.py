"""SlimSpec: a low-rank draft LM head, logits = W_up (W_down h), with full-vocabulary support.

A rank-r head reads r(d + V) weights instead of dV, so at r = d/8 it moves ~8x fewer bytes while
every token stays reachable (unlike a truncated vocabulary). The factors come from an SVD of the
full head (training-free; the best rank-r approximation, Eckart-Young) or from training: a
``LowRankLinear`` module can replace a drafter's ``lm_head`` in the training pipeline.

``LowRankScorer`` holds the two factors in the draft GEMM's layout and scores every drafter row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead, register_head, topk_logprobs
from spechead.kernels.linear import PackedLinear
from spechead.kernels.qlinear import QuantWeight
from spechead.model.lowrank import LowRankLinear, check_rank, default_rank, svd_factors, truncate_factors


class LowRankScorer:
    """Cheap scores for every drafter row: ``(h @ down.T) @ up.T``, r(d + V) weights read. Its columns are
    *drafter rows* (map them through the head's ``row_ids`` for target ids)."""

    def __init__(self, up: Tensor, down: Tensor) -> None:
        if up.shape[1] != down.shape[0]:
            raise SpecheadError(f"low-rank factors disagree: up {tuple(up.shape)}, down {tuple(down.shape)}")
        self.up = PackedLinear(up)  # [V, r]
        self.down = PackedLinear(down)  # [r, d]
        self.factors = (up, down)  # as given, for plain-way references

    @classmethod
    def from_weight(cls, weight: Tensor | LowRankLinear, r: int | None = None) -> LowRankScorer:
        """From a full head (SVD at rank r, default d/8) or from a ``LowRankLinear`` (its factors,
        re-truncated when a smaller r is asked for)."""
        if isinstance(weight, LowRankLinear):
            up, down = weight.up.weight.detach(), weight.down.weight.detach()
            if r is not None and r != up.shape[1]:
                if getattr(weight, "ranked", False) and r < up.shape[1]:  # fitted factors: the best R come first
                    up, down = up[:, :r].contiguous(), down[:r].contiguous()
                else:
                    up, down = truncate_factors(up, down, r)
            return cls(up, down)
        d = weight.shape[1]
        if isinstance(weight, QuantWeight):  # the factors of the matrix the blocks stand for
            weight = weight.blocks().dequantize()
        return cls(*svd_factors(weight, default_rank(d) if r is None else r))

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def nbytes(self) -> int:
        return self.up.nbytes + self.down.nbytes

    def logits(self, h: Tensor) -> Tensor:
        """Scores [B, V_draft] in float32."""
        return self.up(self.down(h))


@register_head("lowrank")
class LowRankHead(DraftHead):
    """SlimSpec head: ``lowrank`` (rank d/8, or the drafter's own low-rank head) or ``lowrank:R``.

    The draft distribution is the softmax of the low-rank logits over the full drafter vocabulary.
    """

    takes_side_factors = True

    def __init__(
        self,
        weight: Tensor | LowRankLinear,
        row_ids: Tensor | None,
        vocab_size: int,
        rank: int | None = None,
    ) -> None:
        super().__init__(weight, row_ids, vocab_size)
        d = weight.in_features if isinstance(weight, LowRankLinear) else weight.shape[1]
        if rank is not None:
            check_rank(rank, d)
        self.scorer = LowRankScorer.from_weight(weight, rank)

    @classmethod
    def options(cls, arg: str) -> dict[str, Any]:
        if not arg:
            return {}
        try:
            return {"rank": int(arg)}
        except ValueError:
            raise SpecheadError(f"lowrank head wants an integer rank (lowrank:R), got {arg!r}") from None

    @classmethod
    def from_spec(
        cls, arg: str, weight: Tensor, row_ids: Tensor | None, vocab_size: int, factors: LowRankLinear | None = None
    ) -> LowRankHead:
        """``lowrank`` / ``lowrank:R``: the drafter's own factors (re-truncated to R) when it has them, else the
        rank-R (default d/8) SVD of its full head."""
        return cls(factors if factors is not None else weight, row_ids, vocab_size, **cls.options(arg))

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with self.timers("head", h.device):
            return topk_logprobs(self.scorer.logits(h), k, self.row_ids)

    def reference_logits(self, h: Tensor) -> Tensor:
        up, down = (f.float() for f in self.scorer.factors)
        ids = torch.arange(up.shape[0], device=h.device) if self.row_ids is None else self.row_ids
        out = torch.full((h.shape[0], self.vocab_size), float("-inf"), device=h.device)
        out[:, ids] = (h.float() @ down.T) @ up.T
        return out

    def stats(self) -> dict[str, float]:
        return {"rank": float(self.scorer.rank)}

    def extra_bytes(self) -> int:
        return self.scorer.nbytes
