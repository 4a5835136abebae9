"""A toy head, the example of adding one: drafts from a seeded random subset of N token ids.

Useless for speed (random ids are rarely the target's next token) and lossless like every head, since
verification never reads a head. Everything the engine, benchmarks, tuner and server need comes from
``DraftHead``: the spec ``random:N[:seed=S]``, its bench case, its bytes per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from spechead.heads.base import BenchSettings, DraftHead, parse_options, register_head, topk_logprobs
from spechead.kernels.linear import PackedLinear


@register_head("random")
class RandomSubsetHead(DraftHead):
    def __init__(self, weight: Tensor, row_ids: Tensor | None, vocab_size: int, n: int = 1024, seed: int = 0) -> None:
        super().__init__(weight, row_ids, vocab_size)
        n = max(1, min(n, weight.shape[0]))
        self.rows = torch.randperm(weight.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
        self.ids = self.rows if row_ids is None else row_ids[self.rows]
        self.lin = PackedLinear(weight[self.rows])

    @classmethod
    def options(cls, arg: str) -> dict[str, Any]:
        return parse_options(arg, {"seed"}, set(), positional="n")

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with self.timers("head", h.device):
            return topk_logprobs(self.lin(h), k, self.ids)

    def reference_logits(self, h: Tensor) -> Tensor:
        return self.dense_logits(h, self.rows)

    def call_bytes(self, batch: int, settings: BenchSettings) -> int:
        e = self.weight.element_size()
        return self.rows.numel() * (self.weight.shape[1] + batch) * e

    def call_flops(self, batch: int, settings: BenchSettings) -> int:
        return 2 * batch * self.rows.numel() * self.weight.shape[1]
