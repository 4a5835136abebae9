"""The baseline head: one GEMM over every row of the drafter's LM head."""

from __future__ import annotations

from torch import Tensor

from spechead.heads.base import DraftHead, register_head, topk_logprobs
from spechead.kernels.linear import PackedLinear


@register_head("full")
class FullHead(DraftHead):
    """The baseline: one GEMM over every row of the drafter's head.

    It uses the same few-row GEMM as every other head (``kernels.PackedLinear``), so the heads' speed
    ratios are ratios of the bytes they read, not of kernel quality. That costs a second copy of the
    head's weight on the CPU (the drafter's own copy is shared with the target when the head is tied).
    """

    def __init__(self, weight: Tensor, row_ids: Tensor | None, vocab_size: int) -> None:
        super().__init__(weight, row_ids, vocab_size)
        self.lin = PackedLinear(weight)

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with self.timers("head", h.device):
            return topk_logprobs(self.lin(h), k, self.row_ids)

    def extra_bytes(self) -> int:
        return self.lin.nbytes if self.lin.kind != "linear" else 0
