"""Hybrid head: NanoSpec's active set with a static backstop of frequent tokens pinned in it."""

from __future__ import annotations

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.heads.base import register_head
from spechead.heads.nanospec import DEFAULT_W_MAX, NanoSpecHead
from spechead.heads.tokenmaps import find_token_map, load_token_map

HYBRID_FREQ = 512  # frequent ids pinned in the set


def frequent_ids(n: int, vocab_size: int, row_ids: Tensor | None) -> Tensor | None:
    """The n most frequent ids of the default frequency list for this vocabulary that the drafter can score
    (``row_ids``: its rows' target ids, None for all); None when no list of at least n ids exists."""
    try:
        path = find_token_map("freq", n, vocab_size, longest=row_ids is not None)
    except SpecheadError:
        return None
    ids = load_token_map(path, vocab_size)
    if row_ids is not None:
        ids = ids[torch.isin(ids, row_ids.cpu())]
    return ids[:n]


@register_head("hybrid")
class HybridHead(NanoSpecHead):
    """NanoSpec's set plus the ``HYBRID_FREQ`` most frequent tokens pinned (where this vocabulary has a frequency
    list and W_max has room for them), with a deeper Ext: the target's top-8 at every tree node.

    The pinned tokens cover what the context has not shown yet (function words, punctuation), and the deeper Ext
    fills the rest of the set faster; both raise acceptance at a set a few hundred ids larger.
    """

    ext_topk = 8

    def __init__(self, weight: Tensor, row_ids: Tensor | None, vocab_size: int, w_max: int | None = None, **kw) -> None:
        pinned = None
        if 4 * HYBRID_FREQ <= (w_max or DEFAULT_W_MAX):
            pinned = frequent_ids(HYBRID_FREQ, vocab_size, row_ids)
        super().__init__(weight, row_ids, vocab_size, w_max, pinned=pinned, **kw)
