"""What the head benchmark (``spechead bench-heads``) knows about each draft head, kept beside the benchmark
rather than in the heads: the configurations it times at a given (d, V) (``bench_cases``), which of its rows
stands for a method's head spec (``bench_key``), and the bytes and FLOPs one draft call moves (``call_bytes``,
``call_flops``).

Bytes per call (e = element size of the dtype): full V*d*e + B*V*e (weights + logits); subset N*d*e + B*N*e;
low-rank (r*d + V*r)*e + B*V*e; NanoSpec and the hybrid W*d*e + B*W*e, plus per round 2*new*d*e (the gather's
read + write) and the tree's target logits observe reads (nodes*V*e), spread over the round's calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.heads import HEADS
from spechead.heads.base import DraftHead, make_head
from spechead.heads.full import FullHead
from spechead.heads.lowrank import LowRankHead
from spechead.heads.nanospec import NanoSpecHead
from spechead.heads.subset import SubsetHead
from spechead.model.lowrank import LowRankLinear, default_rank


@dataclass
class BenchSettings:
    """What the head benchmark varies; each head reads the fields that apply to it."""

    subset: int = 32768  # static-subset size
    rank: int | None = None  # low-rank rank (None: d/8)
    w_max: int = 3072  # NanoSpec's active-set bound
    calls_per_round: int = 6  # draft calls per round (EAGLE-2's root call + depth 5)
    new_per_round: int = 16  # ids a round adds to an active set
    nodes: int = 60  # tree nodes whose target logits a round observes


@dataclass
class BenchCase:
    """One configuration the head benchmark times: a built head under a display name and its spec."""

    name: str
    spec: str
    head: DraftHead
    note: str = ""


CaseMaker = Callable[[Tensor, int, BenchSettings, torch.Generator], list[BenchCase]]


def _full(weight: Tensor, vocab_size: int, settings: BenchSettings, gen: torch.Generator) -> list[BenchCase]:
    return [BenchCase("full", "full", make_head("full", weight, None, vocab_size))]


def _subset(name: str) -> CaseMaker:
    """Random ids: a static subset's cost does not depend on which ids it holds."""

    def cases(weight: Tensor, vocab_size: int, settings: BenchSettings, gen: torch.Generator) -> list[BenchCase]:
        n = min(settings.subset, vocab_size)
        ids = torch.randperm(vocab_size, generator=gen)[:n]
        return [BenchCase(f"{name}:{n}", f"{name}:{n}", HEADS[name](weight, None, vocab_size, ids))]

    return cases


def _lowrank(weight: Tensor, vocab_size: int, settings: BenchSettings, gen: torch.Generator) -> list[BenchCase]:
    """Random factors: an SVD of a random [V, d] matrix takes minutes and does not change the cost."""
    V, d = weight.shape
    r = settings.rank or default_rank(d)
    factors = LowRankLinear.from_random(d, V, r, generator=gen, dtype=weight.dtype, device=weight.device)
    return [BenchCase(f"lowrank:{r}", f"lowrank:{r}", LowRankHead(factors, None, vocab_size))]


def _active_set(name: str, note: str) -> CaseMaker:
    """The set kept full under LRU with the update inside the draft call, so every round pays its gather."""

    def cases(weight: Tensor, vocab_size: int, settings: BenchSettings, gen: torch.Generator) -> list[BenchCase]:
        w_max = min(settings.w_max, vocab_size)
        head = make_head(f"{name}:{w_max}:policy=lru:gather=sync", weight, None, vocab_size)
        return [BenchCase(f"{name}:{w_max}", f"{name}:{w_max}", head, note=note)]

    return cases


CASES: dict[str, CaseMaker] = {
    "full": _full,
    "fr": _subset("fr"),
    "vocabtrim": _subset("vocabtrim"),
    "lowrank": _lowrank,
    "nanospec": _active_set("nanospec", "LRU-full steady state"),
    "hybrid": _active_set("hybrid", "LRU-full steady state, frequent ids pinned"),
}


def bench_cases(
    name: str, weight: Tensor, vocab_size: int, settings: BenchSettings, gen: torch.Generator
) -> list[BenchCase]:
    """The configurations the benchmark times for head ``name`` over a random [V, d] ``weight`` (costs do not
    depend on the values)."""
    if name not in CASES:
        raise SpecheadError(f"head {name!r} has no head-benchmark entry (spechead/bench/head_costs.py)")
    return CASES[name](weight, vocab_size, settings, gen)


def bench_key(spec: str, keys: list[str]) -> str | None:
    """Which head-benchmark row stands for a method's head ``spec``: the row of that spec, else the head's row
    (for a static subset, its largest list)."""
    name = spec.partition(":")[0]
    if name in ("fr", "vocabtrim"):
        mine = [k for k in keys if k.partition(":")[0] == name and k.partition(":")[2].isdigit()]
        return max(mine, key=lambda k: int(k.partition(":")[2])) if mine else None
    if spec in keys:
        return spec
    return next((k for k in keys if k.partition(":")[0] == name), None)


def call_bytes(head: DraftHead, batch: int, settings: BenchSettings) -> int:
    """Bytes one draft call at ``batch`` rows reads and writes in the steady state: weights plus logits (work done
    once per round is spread over ``settings.calls_per_round`` calls)."""
    if isinstance(head, LowRankHead):
        (V, r), d, e = head.scorer.up.shape, head.scorer.down.shape[1], head.scorer.up.dtype.itemsize
        return (r * d + V * r) * e + batch * V * e
    d, e = head.weight.shape[1], head.weight.element_size()
    if isinstance(head, FullHead):
        V = head.weight.shape[0]
        return V * d * e + batch * V * e
    if isinstance(head, SubsetHead):
        return head.size * d * e + batch * head.size * e
    if isinstance(head, NanoSpecHead):
        calls, n = settings.calls_per_round, head.w_max
        per_round = calls * (n * d * e + batch * n * e) + 2 * settings.new_per_round * d * e
        return (per_round + settings.nodes * head.vocab_size * e) // calls
    raise SpecheadError(f"head {head.name!r} has no bytes per call (spechead/bench/head_costs.py)")


def call_flops(head: DraftHead, batch: int, settings: BenchSettings) -> int:
    """2 x multiply-adds of the call's GEMMs (top-k, softmax and gathers are not counted)."""
    if isinstance(head, LowRankHead):
        V, d = head.scorer.up.shape[0], head.scorer.down.shape[1]
        return 2 * batch * head.scorer.rank * (d + V)
    if isinstance(head, FullHead):
        rows = head.weight.shape[0]
    elif isinstance(head, SubsetHead):
        rows = head.size
    elif isinstance(head, NanoSpecHead):
        rows = head.w_max
    else:
        raise SpecheadError(f"head {head.name!r} has no FLOPs per call (spechead/bench/head_costs.py)")
    return 2 * batch * rows * head.weight.shape[1]
