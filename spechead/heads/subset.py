"""Static-subset heads: FR-Spec (``fr:N`` / ``fr:PATH``) and VocabTrim (``vocabtrim:N`` / ``vocabtrim:PATH``).

Both draft from a fixed list of token ids: the head's rows for those ids are gathered once into a
packed [N, d] buffer, so each call is one dense GEMM over N rows instead of V (a gather per call
would move the same bytes twice). The draft distribution is the softmax over the subset; top-k
indices are mapped back to target ids. Tokens outside the list can never be drafted, but the
target still verifies over the full vocabulary, so the output is unchanged.

When the drafter has a reduced vocabulary of its own (EAGLE-3 ``d2t``), only listed ids that the
drafter can produce are kept; ``fr:N`` then takes the N best of those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead, register_head, topk_logprobs
from spechead.heads.tokenmaps import check_token_ids, find_token_map, load_token_map
from spechead.kernels.linear import PackedLinear
from spechead.model.lowrank import LowRankLinear

DEFAULT_SIZE = 32768  # FR-Spec's and SGLang's usual list size


class SubsetHead(DraftHead):
    """Draft over a fixed, ranked list of target ids ``ids``."""

    kind = "freq"  # which default list ``name:N`` reads

    def __init__(
        self, weight: Tensor, row_ids: Tensor | None, vocab_size: int, ids: Tensor | None = None, n: int | None = None
    ) -> None:
        super().__init__(weight, row_ids, vocab_size)
        if ids is None:  # plain ``fr`` / ``vocabtrim``: the default list at the papers' size, else the longest
            n = min(DEFAULT_SIZE, vocab_size)
            try:
                ids = self.default_list(n, row_ids is not None, vocab_size)
            except SpecheadError:
                ids = self.default_list(1, True, vocab_size)
        ids = check_token_ids(torch.as_tensor(ids, dtype=torch.long).flatten().cpu(), vocab_size, self.name)
        if row_ids is None:
            if weight.shape[0] != vocab_size:
                raise SpecheadError(f"head has {weight.shape[0]} rows but no row->token map for V={vocab_size}")
            rows = ids
        else:  # target id -> drafter row, -1 where the drafter's vocabulary lacks the id
            to_row = torch.full((vocab_size,), -1, dtype=torch.long)
            to_row[row_ids.cpu()] = torch.arange(row_ids.numel())
            rows = to_row[ids]
        keep = rows >= 0
        self.dropped = int((~keep).sum())
        rows, ids = rows[keep], ids[keep]
        if n is not None:
            rows, ids = rows[:n], ids[:n]
        if rows.numel() == 0:
            raise SpecheadError(f"{self.name}: none of the listed ids is in the drafter's vocabulary")
        dev = weight.device
        self.ids = ids.to(dev)  # packed row -> target id
        self.packed = PackedLinear(weight.detach()[rows.to(dev)])  # gathered (and packed) once: [N, d]

    @classmethod
    def default_list(cls, n: int, reduced: bool, vocab_size: int) -> Tensor:
        """The default ranked list holding at least n ids; the longest one when the drafter's own
        vocabulary is reduced, since ids it lacks are filtered out before cutting to n."""
        return load_token_map(find_token_map(cls.kind, n, vocab_size, longest=reduced), vocab_size)

    @classmethod
    def options(cls, arg: str) -> dict[str, Any]:
        """``N`` (the first N ids of the default list for this vocabulary) or a token-map file path."""
        if not arg:
            return {}
        if arg.lstrip("-").isdigit():
            if int(arg) <= 0:
                raise SpecheadError(f"{cls.name}:N needs 1 <= N <= the vocabulary size, got {arg}")
            return {"n": int(arg)}
        if not Path(arg).is_file():
            raise SpecheadError(f"{cls.name}: token map not found: {arg}")
        return {"path": arg}

    @classmethod
    def from_spec(
        cls, arg: str, weight: Tensor, row_ids: Tensor | None, vocab_size: int, factors: LowRankLinear | None = None
    ) -> SubsetHead:
        opts = cls.options(arg)
        if "path" in opts:
            return cls(weight, row_ids, vocab_size, load_token_map(opts["path"], vocab_size))
        if "n" in opts:
            n = opts["n"]
            if n > vocab_size:
                raise SpecheadError(f"{cls.name}:N needs 1 <= N <= {vocab_size} (the vocabulary size), got {n}")
            return cls(weight, row_ids, vocab_size, cls.default_list(n, row_ids is not None, vocab_size), n)
        return cls(weight, row_ids, vocab_size)

    @property
    def size(self) -> int:
        return self.ids.numel()

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with self.timers("head", h.device):
            return topk_logprobs(self.packed(h), k, self.ids)

    def reference_logits(self, h: Tensor) -> Tensor:
        out = self.dense_logits(h)
        keep = torch.zeros(self.vocab_size, dtype=torch.bool, device=out.device)
        keep[self.ids] = True
        return out.masked_fill(~keep, float("-inf"))

    def stats(self) -> dict[str, float]:
        return {"active_size": float(self.size), "dropped_ids": float(self.dropped)}

    def extra_bytes(self) -> int:
        return self.packed.nbytes + self.ids.numel() * self.ids.element_size()


@register_head("fr")
class FrequencyHead(SubsetHead):
    """FR-Spec: the N most frequent tokens of a corpus (``spechead freq``)."""

    kind = "freq"


@register_head("vocabtrim")
class VocabTrimHead(SubsetHead):
    """VocabTrim: the N tokens the drafter proposes most on target-generated replies (``spechead vocabtrim``)."""

    kind = "vocabtrim"
