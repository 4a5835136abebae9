"""What the head benchmark (``spechead bench-heads``) knows about each draft head, kept beside the benchmark
rather than in the heads: the configurations it times at a given (d, V) (``bench_cases``), which of its rows
stands for a method's head spec (``bench_key``), and the bytes and FLOPs one draft call moves (``call_bytes``,
``call_flops``).

Bytes per call (row = bytes of one weight row, d*e for a dtype of e bytes; e = bytes of a logit): full V*row + B*V*e
(weights + logits); subset N*row + B*N*e; low-rank (the factors' rows) + B*V*e; NanoSpec and the hybrid W*row + B*W*e,
plus per round 2*new*row (the gather's read + write) and the tree's target logits observe reads (nodes*V*e), spread
over the round's calls. With integer blocks (``q8`` / ``q4``) a row is its d/32 blocks with their fp32 scale (and
q4's minimum) and the logits are fp32.

The integer kernel's compute floor: its multiply-adds over ``IntPeak`` (``INT_MACS_PER_CYCLE`` of the kernel path
x clock x threads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from spechead import kernels
from spechead.errors import SpecheadError
from spechead.heads import HEADS
from spechead.heads.base import DraftHead, make_head
from spechead.heads.full import FullHead
from spechead.heads.lowrank import LowRankHead, LowRankScorer
from spechead.heads.nanospec import NanoSpecHead
from spechead.heads.subset import SubsetHead
from spechead.kernels.qlinear import PANEL, QuantWeight
from spechead.kernels.quant import BLOCK, quantize
from spechead.model.lowrank import LowRankLinear, default_rank
from spechead.tuning.measure import cpu_mhz, cpuinfo_field

# int8 multiply-adds per cycle per core of each integer-kernel path (``kernels.ops().qlinear_path()``), by format
INT_MACS_PER_CYCLE = {
    "amx": {"q8": 1024, "q4": 1024},  # tdpbssd
    "avx512-vnni": {"q8": 128, "q4": 128},  # vpdpbusd: 64 a port, 2 ports (Intel's server cores; AMD: below)
    "avx2": {"q8": 32, "q4": 64},  # q4: 2 vpmaddubsw (32 pairs) a cycle; q8: vpmaddubsw + vpmaddwd per 32 MACs
    "portable": {"q8": 16, "q4": 16},
}
# AMD Zen 4 runs a 512-bit vpdpbusd as two 256-bit halves, one a cycle (3.65 per ns measured at ~3.6 GHz)
AMD_VNNI_MACS_PER_CYCLE = 64
AMX_ROWS = 32  # calls of fewer rows take vpdpbusd on an AMX path (csrc/qgemm.cpp, kAmxRows)


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
    fmt = weight.format if isinstance(weight, QuantWeight) else None
    if fmt is not None and r % BLOCK:
        raise SpecheadError(f"lowrank:{r} at {fmt}: the rank must be a multiple of {BLOCK} (set --rank)")
    dtype = torch.float32 if fmt is not None else weight.dtype
    factors = LowRankLinear.from_random(d, V, r, generator=gen, dtype=dtype, device=weight.device)
    head = LowRankHead(factors, None, vocab_size)
    if fmt is not None:  # both factors as blocks, on the integer kernel
        head.scorer = LowRankScorer(*(quantize(m.weight.detach(), fmt) for m in (factors.up, factors.down)))
    return [BenchCase(f"lowrank:{r}", f"lowrank:{r}", head)]


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


def row_bytes(weight: Tensor | QuantWeight) -> int:
    """Bytes of one row of a head's matrix: d elements, or d/32 blocks with their scale (and q4's minimum)."""
    if isinstance(weight, QuantWeight):
        return weight.nbytes // (weight.data.shape[0] * PANEL)
    return weight.shape[1] * weight.element_size()


def logit_bytes(weight: Tensor | QuantWeight) -> int:
    """Bytes of one logit: the weight's element size; fp32 from the integer kernel."""
    return 4 if isinstance(weight, QuantWeight) else weight.element_size()


def call_bytes(head: DraftHead, batch: int, settings: BenchSettings) -> int:
    """Bytes one draft call at ``batch`` rows reads and writes in the steady state: weights plus logits (work done
    once per round is spread over ``settings.calls_per_round`` calls)."""
    if isinstance(head, LowRankHead):
        up, down = head.scorer.up, head.scorer.down
        (V, r), d = up.shape, down.shape[1]
        if up.quant is not None:
            return V * row_bytes(up.quant) + r * row_bytes(down.quant) + batch * V * 4
        e = up.dtype.itemsize
        return (r * d + V * r) * e + batch * V * e
    row, e = row_bytes(head.weight), logit_bytes(head.weight)
    if isinstance(head, FullHead):
        V = head.weight.shape[0]
        return V * row + batch * V * e
    if isinstance(head, SubsetHead):
        return head.size * row + batch * head.size * e
    if isinstance(head, NanoSpecHead):
        calls, n = settings.calls_per_round, head.w_max
        per_round = calls * (n * row + batch * n * e) + 2 * settings.new_per_round * row
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


@dataclass
class IntPeak:
    """The integer kernel's multiply-add peak: ``INT_MACS_PER_CYCLE`` of its path x the core clock x the threads."""

    path: str  # kernels.ops().qlinear_path()
    fmt: str  # q8 / q4
    mhz: float
    clock: str  # where mhz comes from
    threads: int
    amd: bool = False  # an AMD CPU: vpdpbusd at AMD_VNNI_MACS_PER_CYCLE

    @classmethod
    def of(cls, fmt: str) -> IntPeak | None:
        """The peak of this machine's integer kernel at ``fmt`` and torch's threads (None without a kernel build or a
        clock)."""
        clock = cpu_mhz() if kernels.available() else None
        if clock is None:
            return None
        amd = cpuinfo_field("vendor_id") == "AuthenticAMD"
        return cls(kernels.ops().qlinear_path(), fmt, clock[0], clock[1], torch.get_num_threads(), amd)

    def report(self) -> dict:
        """The path and the figures the peak is made of."""
        out = {
            "path": self.path,
            "macs_per_cycle_per_core": self.macs_per_cycle(AMX_ROWS),
            "clock_MHz": round(self.mhz, 1),
            "clock_source": self.clock,
            "threads": self.threads,
            "peak_GMACs": round(self.gmacs(AMX_ROWS), 1),
        }
        if self.path_at(1) != self.path:
            out[f"path_below_{AMX_ROWS}_rows"] = self.path_at(1)
        return out

    def path_at(self, rows: int) -> str:
        """The path a call of ``rows`` rows takes."""
        return "avx512-vnni" if self.path == "amx" and rows < AMX_ROWS else self.path

    def macs_per_cycle(self, rows: int) -> int:
        path = self.path_at(rows)
        return AMD_VNNI_MACS_PER_CYCLE if self.amd and path == "avx512-vnni" else INT_MACS_PER_CYCLE[path][self.fmt]

    def gmacs(self, rows: int) -> float:
        """Peak multiply-adds per second at ``rows`` rows, in units of 1e9."""
        return self.macs_per_cycle(rows) * self.mhz * 1e-3 * self.threads
