"""The baseline head: one GEMM over every row of the drafter's LM head."""

from __future__ import annotations

from torch import Tensor

from spechead.heads.base import DraftHead, register_head, topk_logprobs
from spechead.heads.lowrank import LowRankHead
from spechead.kernels.linear import PackedLinear
from spechead.model.lowrank import LowRankLinear


@register_head("full")
class FullHead(DraftHead):
    """The baseline: one GEMM over every row of the drafter's head.

    It uses the same few-row GEMM as every other head (``kernels.PackedLinear``), so the heads' speed
    ratios are ratios of the bytes they read, not of kernel quality. A head tied to the target's (EAGLE-2's)
    shares the target's laid-out LM head (``BlockedWeight.of``); an untied one costs a second copy of its weight.
    """

    def __init__(self, weight: Tensor, row_ids: Tensor | None, vocab_size: int) -> None:
        super().__init__(weight, row_ids, vocab_size)
        self.lin = PackedLinear(weight)

    @classmethod
    def from_spec(
        cls, arg: str, weight: Tensor, row_ids: Tensor | None, vocab_size: int, factors: LowRankLinear | None = None
    ) -> DraftHead:
        """A drafter trained with a SlimSpec head has no other head: its full head is its own factors."""
        cls.options(arg)
        if factors is not None:
            return LowRankHead(factors, row_ids, vocab_size)
        return cls(weight, row_ids, vocab_size)

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with self.timers("head", h.device):
            return topk_logprobs(self.lin(h), k, self.row_ids)

    def reference_logits(self, h: Tensor) -> Tensor:
        return self.dense_logits(h)

    def extra_bytes(self) -> int:
        return self.lin.nbytes if self.lin.kind != "linear" and not self.lin.shares_layout else 0
