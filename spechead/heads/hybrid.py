"""Hybrid head: NanoSpec's active set plus a low-rank scorer over the rest of the vocabulary."""

from __future__ import annotations

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.heads.base import BenchCase, BenchSettings, register_head, topk_logprobs
from spechead.heads.lowrank import LowRankScorer
from spechead.heads.nanospec import (
    DEFAULT_W_MAX,
    NanoSpecHead,
)
from spechead.model.lowrank import LowRankLinear, check_rank, default_rank, svd_factors

HYBRID_FREQ = 512


def _has_freq_list(vocab_size: int) -> bool:
    from spechead.heads.tokenmaps import find_token_map

    try:
        find_token_map("freq", HYBRID_FREQ, vocab_size)
        return True
    except SpecheadError:
        return False


@register_head("hybrid")
class HybridHead(NanoSpecHead):
    """NanoSpec's set plus a low-rank full-vocabulary escape of ``m`` ids per row.

    ``rank`` defaults to d/8; ``escape_calls`` is how many draft calls per round get an escape (1 = the
    root call only, which decides whether anything of the round is accepted); ``escape_add`` decides
    what reaches the set for later rounds: ``tree`` (escape ids that were drafted into the tree, via
    Ext's tree-token source), ``all`` (every escape proposal) or ``none``.
    """

    INT_OPTS = NanoSpecHead.INT_OPTS | {"m", "rank", "escape_calls"}
    STR_OPTS = NanoSpecHead.STR_OPTS | {"escape_add"}

    def __init__(
        self,
        weight: Tensor,
        row_ids: Tensor | None,
        vocab_size: int,
        w_max: int | None = None,
        m: int = 0,
        rank: int | None = None,
        escape_calls: int = 1,
        escape_add: str = "tree",
        scorer: LowRankScorer | None = None,
        ext_topk: int = 8,
        freq: int | None = None,
        **kw,
    ) -> None:
        if freq is None:  # the frequent backstop when this vocabulary has a list (measured best: 512)
            freq = HYBRID_FREQ if _has_freq_list(vocab_size) and 4 * HYBRID_FREQ <= (w_max or DEFAULT_W_MAX) else 0
        super().__init__(weight, row_ids, vocab_size, w_max, ext_topk=ext_topk, freq=freq, **kw)
        if not 0 <= m <= weight.shape[0]:
            raise SpecheadError(f"hybrid m must be in [0, {weight.shape[0]}], got {m}")
        if escape_calls < 0:
            raise SpecheadError(f"escape_calls must be >= 0, got {escape_calls}")
        if escape_add not in ("tree", "all", "none"):
            raise SpecheadError(f"escape_add must be one of tree, all, none; got {escape_add!r}")
        rank = rank if rank is not None else default_rank(weight.shape[1])
        check_rank(rank, weight.shape[1])
        if scorer is None and m:
            scorer = LowRankScorer(*svd_factors(weight, rank))
        self.scorer = scorer
        self.m, self.rank, self.escape_add = m, scorer.rank if scorer is not None else rank, escape_add
        self.escape_calls = escape_calls if m else 0  # m=0: no escape (the frequent backstop only)
        self._calls = 0  # draft calls in the current round
        self._row_mask: Tensor | None = None  # membership over drafter rows, refreshed per round

    def begin(self, prompt_ids: Tensor, prompt_logits: Tensor | None) -> None:
        super().begin(prompt_ids, prompt_logits)
        self._calls, self._row_mask = 0, None

    def observe(self, tree_tokens: Tensor, node_logits: Tensor, committed: list[int]) -> None:
        self._wait()
        if self.escape_add == "none":  # drafted ids outside the set are escape proposals: keep them out
            tree_tokens = tree_tokens[self.in_set[tree_tokens]]
        super().observe(tree_tokens, node_logits, committed)
        self._calls, self._row_mask = 0, None

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        self._ready(h)
        self._calls += 1
        if self.n == 0 or self._calls > self.escape_calls:
            return self._set_topk(h, k)
        if self._row_mask is None:
            self._row_mask = self.in_set if self.row_ids is None else self.in_set[self.row_ids]
        with self.timers("head", h.device):
            z_set = self.packed(h, self.n)  # [B, n] float32
            esc = self.scorer.candidates(h, self.m, exclude=self._row_mask)  # [B, m] drafter rows outside the set
            z_esc = torch.einsum("bd,bmd->bm", h.to(self.weight.dtype), self.weight[esc]).float()  # exact logits
            logp, idx = topk_logprobs(torch.cat([z_set, z_esc], dim=-1), k)
            esc_ids = esc if self.row_ids is None else self.row_ids[esc]
            union = torch.cat([self.ids[: self.n].expand(h.shape[0], -1), esc_ids], dim=-1)
            if self.escape_add == "all":
                self._escaped.append(esc_ids.flatten())
            return logp, union.gather(1, idx)

    def reference_logits(self, h: Tensor) -> Tensor:
        """The set's logits, plus on an escaping call the exact logits of the scorer's m best rows outside it."""
        out = super().reference_logits(h)
        if self.n == 0 or self._calls + 1 > self.escape_calls:
            return out
        in_rows = self.in_set if self.row_ids is None else self.in_set[self.row_ids]
        esc = self.scorer.candidates(h, self.m, exclude=in_rows)  # [B, m] drafter rows
        for b in range(h.shape[0]):
            ids = esc[b] if self.row_ids is None else self.row_ids[esc[b]]
            out[b, ids] = h[b].float() @ self.weight[esc[b]].float().T
        return out

    @classmethod
    def bench_cases(
        cls, weight: Tensor, vocab_size: int, settings: BenchSettings, gen: torch.Generator
    ) -> list[BenchCase]:
        """Its defaults, and the low-rank escape on random factors at the low-rank head's rank."""
        V, d = weight.shape
        w_max, r = min(settings.w_max, vocab_size), settings.rank or default_rank(d)
        common = {"w_max": w_max, "policy": "lru", "gather": "sync"}
        factors = LowRankLinear.from_random(d, V, r, generator=gen, dtype=weight.dtype)
        scorer = LowRankScorer(factors.up.weight, factors.down.weight)
        cases = []
        for name, spec, extra, note in [
            (f"hybrid:{w_max}", f"hybrid:{w_max}", {}, "its defaults"),
            (
                f"hybrid+esc{settings.escape_m}",
                f"hybrid:{w_max}:m={settings.escape_m}:rank={r}",
                {"m": settings.escape_m, "scorer": scorer},
                "escape",
            ),
        ]:
            head = cls(weight, None, vocab_size, **common, **extra)
            desc = f"{note}: m={head.m}, escape_calls={head.escape_calls}"
            cases.append(BenchCase(name, spec, head, note=desc))
        return cases

    def call_bytes(self, batch: int, settings: BenchSettings) -> int:
        """NanoSpec's bytes plus, on the calls that escape, the low-rank scores and the m exact rows."""
        d, e, calls = self.weight.shape[1], self.weight.element_size(), settings.calls_per_round
        r, V, m = self.rank, self.vocab_size, self.m
        escape = min(self.escape_calls, calls) * ((r * d + V * r) * e + batch * V * e + batch * m * d * e)
        return super().call_bytes(batch, settings) + escape // calls

    def call_flops(self, batch: int, settings: BenchSettings) -> int:
        calls = settings.calls_per_round
        escape = (
            min(self.escape_calls, calls)
            * 2
            * batch
            * (self.rank * (self.weight.shape[1] + self.vocab_size) + self.m * self.weight.shape[1])
        )
        return super().call_flops(batch, settings) + escape // calls

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["rank"] = float(self.rank)
        return out

    def extra_bytes(self) -> int:
        return super().extra_bytes() + (self.scorer.nbytes if self.scorer is not None else 0)
