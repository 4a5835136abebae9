"""``spechead bench-heads``: every draft head at a real model's (d, V), random weights, one run.

Per head and batch (rows per ``topk`` call; EAGLE-2's tree expands top_k = 10 nodes per call):
median ms per call, the bytes the call must move, the floor those bytes set at the machine's
measured copy bandwidth, the achieved bandwidth and the speed ratio against the full head.

How it measures, and why:
- Cold cache by default: between two draft calls the drafter's backbone layer streams hundreds of MB,
  which evicts a small head from the last-level cache; so a buffer twice the LLC is read before every
  timed call (not timed). ``--hot`` skips that.
- NanoSpec and the hybrid head are timed by *rounds*: ``observe`` (the Ext update: top-k over the
  tree's target logits, new ids, their rows gathered) plus ``calls_per_round`` draft calls, divided by
  the calls. The set is kept full at W_max with LRU eviction and ``new_per_round`` fresh ids a round,
  so every round pays a real gather.
- Heads are interleaved within each repeat (noise from other processes hits all of them alike),
  after one warm-up round each.
- On a CUDA device (``--device cuda``) the weights, the flush buffer (twice the L2 cache) and the copy meter live
  on the device, and every timed span ends with ``torch.cuda.synchronize``.
- ``q8`` / ``q4``: every head's matrix is 32-value integer blocks (``QuantWeight``) on spechead's integer kernel;
  the compute floor is then the kernel path's multiply-add peak (``head_costs.IntPeak``), not a measured rate.

Which cases each head gets and the bytes and FLOPs its calls move: ``bench.head_costs``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from spechead import kernels
from spechead.bench.head_costs import BenchCase, BenchSettings, IntPeak, bench_cases, call_bytes, call_flops
from spechead.errors import SpecheadError
from spechead.heads import HEADS
from spechead.heads.base import DraftHead
from spechead.kernels.linear import BlockedWeight, PackedLinear
from spechead.kernels.qlinear import QuantWeight
from spechead.kernels.quant import FORMATS, quantize
from spechead.tuning.measure import CopyMeter, llc_bytes

SHAPES = {  # (d, V) of the paper's targets, the demo and Gemma 3 270M (the real target whose head dominates)
    "llama3.1-8b": (4096, 128256),
    "llama3.2-1b": (2048, 128256),
    "qwen3-8b": (4096, 151936),
    "demo": (576, 49152),
    "gemma3-270m": (640, 262144),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DTYPE_NAMES = (*DTYPES, *FORMATS)  # the float dtypes, then the integer kernel's block formats
CPU = torch.device("cpu")


def act_dtype(name: str) -> torch.dtype:
    """The dtype of the heads' inputs and the target's logits: the float dtype, fp32 with integer blocks."""
    return DTYPES.get(name, torch.float32)


def head_matrix(V: int, d: int, name: str, gen: torch.Generator, device: torch.device = CPU) -> Tensor | QuantWeight:
    """A random [V, d] head matrix (std 0.02) in ``name``: a float tensor, or integer blocks (``QuantWeight``)."""
    W = torch.randn(V, d, generator=gen, device=device) * 0.02
    return W.to(DTYPES[name]) if name in DTYPES else QuantWeight.pack(quantize(W, name))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a wall-clock span covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_bytes(device: torch.device) -> int:
    """The last-level cache a flush must evict: the CPU's LLC, or a CUDA device's L2."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    return llc_bytes()


class Flusher:
    """Evicts the caches by reading a buffer twice the last-level cache (a no-op with ``hot``)."""

    def __init__(self, hot: bool, device: torch.device = CPU) -> None:
        self.buf = None if hot else torch.ones(min(2 * cache_bytes(device), 2**30) // 4, device=device)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.sum()


class DeviceCopyMeter(CopyMeter):
    """``CopyMeter`` on a CUDA device: the buffers live there, and each timed copy or sum is synchronised."""

    def __init__(self, device: torch.device, nbytes: int = 1024 * 2**20) -> None:
        self.device, self.nbytes, self.samples = device, nbytes, []
        self.src = torch.ones(nbytes // 4, device=device)
        self.dst = torch.empty_like(self.src)

    def _timed(self, fn: Callable[[], object]) -> float:
        synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        synchronize(self.device)
        return time.perf_counter() - t0

    def sample(self) -> float:
        gbps = 2 * self.nbytes / self._timed(lambda: self.dst.copy_(self.src)) / 1e9
        self.samples.append(gbps)
        return gbps

    def start(self, repeats: int = 7) -> dict[str, float]:
        self.sample()
        copy = statistics.median(self.sample() for _ in range(repeats))
        self._timed(self.src.sum)
        read = self.nbytes / statistics.median(self._timed(self.src.sum) for _ in range(repeats)) / 1e9
        self.samples.clear()
        return {"copy_GBps": copy, "read_GBps": read, "buffer_MB": self.nbytes / 2**20}


def copy_meter(device: torch.device) -> CopyMeter:
    """The copy-bandwidth meter for the device the heads run on."""
    return DeviceCopyMeter(device) if device.type == "cuda" else CopyMeter()


class GemmRate:
    """The GEMM throughput this machine reaches at a given batch, weights in cache (GFLOP/s), in dtype ``name``
    (integer blocks: the integer kernel's).

    With few rows a GEMM does 2*B flops per weight element: at B=10 in bf16 that is 10 flops per byte,
    more than a CPU core's vector units deliver per byte of DRAM bandwidth, so the bytes floor is not
    reachable. This rate gives a float head's compute floor; the roofline floor is the larger of the two.
    """

    def __init__(self, d: int, name: str, rows: int = 512, device: torch.device = CPU) -> None:
        w = head_matrix(rows, d, name, torch.Generator().manual_seed(0))
        self.lin = PackedLinear(w.to(device) if isinstance(w, Tensor) else w)
        self.rows, self.d, self.dtype, self.device = rows, d, act_dtype(name), device
        self.samples: dict[int, list[float]] = {}

    def sample(self, B: int, calls: int = 10) -> float:
        h = torch.randn(B, self.d).to(device=self.device, dtype=self.dtype)
        self.lin(h)
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(calls):
            self.lin(h)
        synchronize(self.device)
        rate = 2 * B * self.rows * self.d * calls / (time.perf_counter() - t0) / 1e9
        self.samples.setdefault(B, []).append(rate)
        return rate

    def median(self, B: int) -> float:
        return statistics.median(self.samples[B])


# -- heads under test: every registered head's cases (head_costs.bench_cases) ---------------------
@dataclass
class Timed:
    """A head's bench case with its timings per batch."""

    case: BenchCase
    timings: dict[int, list[float]] = field(default_factory=dict)
    rounds: dict[int, list[tuple[float, float, float]]] = field(default_factory=dict)  # observe, 1st call, rest
    feeder: RoundFeeder | None = None

    @property
    def name(self) -> str:
        return self.case.name

    @property
    def head(self) -> DraftHead:
        return self.case.head


def settings_of(args) -> BenchSettings:
    return BenchSettings(
        subset=args.subset,
        rank=args.rank,
        w_max=args.w_max,
        calls_per_round=args.calls_per_round,
        new_per_round=args.new_per_round,
        nodes=args.nodes,
    )


def build_cases(W: Tensor, V: int, settings: BenchSettings, gen: torch.Generator) -> tuple[list[Timed], dict[str, str]]:
    """Every registered head's cases at this shape, the full head first (the ratios' reference); a head that
    cannot be built here is reported as skipped with its reason."""
    cases, skipped = [], {}
    for name in sorted(HEADS, key=lambda n: n != "full"):
        try:
            cases += [Timed(c) for c in bench_cases(name, W, V, settings, gen)]
        except SpecheadError as e:
            skipped[name] = str(e)
    return cases, skipped


class RoundFeeder:
    """Inputs for NanoSpec-style rounds: a prompt that fills the set, then per round a tree whose nodes'
    target top-``topk`` hold ``new`` fresh ids and a fixed pool of ids already in the set (``topk`` is
    the head's Ext depth, so no arbitrary tie breaks the count). The pool is hit every round, so LRU
    never evicts it, and each round gathers exactly ``new`` rows (the steady state)."""

    def __init__(self, V: int, w_max: int, nodes: int, new: int, topk: int, gen: torch.Generator) -> None:
        self.V, self.nodes, self.new, self.k, self.gen = V, nodes, new, max(topk, 1), gen
        self.perm = torch.randperm(V, generator=gen)
        self.prompt = self.perm[:w_max]  # fills the set (its logits are left out)
        self.settle(self.prompt)

    def settle(self, resident: Tensor) -> None:
        """Pool from the ids the head really holds (a head may pin some ids of its own); fresh ids from the rest."""
        self.pool = resident[: max(min(self.k * self.nodes - self.new, resident.numel()), 1)]
        outside = torch.ones(self.V, dtype=torch.bool)
        outside[resident] = False
        self.perm = self.perm[outside[self.perm]]
        self.cursor = 0

    def fresh(self, n: int) -> Tensor:
        if self.cursor + n > self.perm.numel():
            self.cursor = 0
        out = self.perm[self.cursor : self.cursor + n]
        self.cursor += n
        return out

    def round(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, list[int]]:
        known = self.pool[torch.randperm(self.pool.numel(), generator=self.gen)]
        picks = torch.cat([self.fresh(self.new), known])
        short = self.k * self.nodes - picks.numel()  # > 0 only when W_max is smaller than the pool wanted
        if short > 0:
            picks = torch.cat([picks, known.repeat(-(-short // known.numel()))[:short]])
        top = picks[: self.k * self.nodes].view(self.k, self.nodes).T  # fresh ids on the nodes' top-1 first
        logits = torch.zeros(self.nodes, self.V, dtype=dtype)
        scores = torch.arange(self.k, 0, -1, dtype=torch.float32).to(dtype)
        logits.scatter_(1, top, scores.expand(self.nodes, self.k))
        tree = top[:, 0].clone()
        return tree, logits, tree[:3].tolist()


def time_case(case: Timed, h: Tensor, k: int, flush: Flusher, args) -> float:
    """Milliseconds per draft call for one repeat (cold caches before every call unless --hot)."""
    head, dev = case.head, h.device

    def timed(fn: Callable[[], object]) -> float:
        flush()
        synchronize(dev)
        t0 = time.perf_counter()
        fn()
        synchronize(dev)
        return time.perf_counter() - t0

    if not case.head.per_round:
        return timed(lambda: head.topk(h, k)) * 1e3
    tree, logits, committed = case.feeder.round(h.dtype)
    logits = logits.to(dev)
    parts = [timed(lambda: head.observe(tree, logits, committed))]
    for _ in range(args.calls_per_round):
        parts.append(timed(lambda: head.topk(h, k)))
    rest = parts[2:]
    case.rounds.setdefault(h.shape[0], []).append(
        (parts[0] * 1e3, parts[1] * 1e3, sum(rest) * 1e3 / len(rest) if rest else 0.0)
    )
    return sum(parts) * 1e3 / args.calls_per_round


@torch.inference_mode()
def bench_shape(
    shape: str,
    batches: list[int],
    dtype_name: str,
    args,
    flush: Flusher,
    meter: CopyMeter,
    device: torch.device = CPU,
    dims: tuple[int, int] | None = None,
    deadline: float | None = None,
) -> dict:
    """Every head at ``shape`` (or at ``dims`` = (d, V) under that name) on ``device``. With ``deadline`` (a
    ``time.perf_counter()`` value), the batches after the first not started by then are skipped and listed in the
    result (``skipped_batches``)."""
    d, V = dims or SHAPES[shape]
    gen = torch.Generator().manual_seed(args.seed)
    wgen = gen if device.type == "cpu" else torch.Generator(device).manual_seed(args.seed)
    W = head_matrix(V, d, dtype_name, wgen, device)
    settings = settings_of(args)
    cases, skipped = build_cases(W, V, settings, gen)
    for c in cases:
        if c.head.per_round:
            topk = getattr(c.head, "ext_topk", 3)
            c.feeder = RoundFeeder(V, c.head.w_max, args.nodes, args.new_per_round, topk, gen)
            c.head.begin(c.feeder.prompt, None)
            if hasattr(c.head, "state"):
                c.feeder.settle(c.head.state()[0].cpu())
    rate = GemmRate(d, dtype_name, device=device)
    peak = IntPeak.of(dtype_name) if dtype_name in FORMATS else None
    evicted0 = {c.name: c.head.stats().get("evicted", 0.0) for c in cases if c.head.per_round}
    skipped_batches = _time_batches(cases, batches, d, args, flush, meter, rate, gen, device, deadline)
    batches = [B for B in batches if B not in skipped_batches]
    gbps = meter.median()
    out = {
        "d": d,
        "V": V,
        "dtype": dtype_name,
        "copy_GBps": round(gbps, 2),
        "gemm_GFLOPs_in_cache": {str(B): round(rate.median(B), 1) for B in batches},
        "compute_floor": "in-cache GEMM rate" if peak is None else "integer peak",
        **({"int_kernel": peak.report()} if peak is not None else {}),
        "heads": {},
        "skipped": skipped,
    }
    if skipped_batches:
        out["skipped_batches"] = skipped_batches
    full_ms = {B: statistics.median(cases[0].timings[B]) for B in batches}
    for c in cases:
        rows = {str(B): _row(c, B, settings, gbps, rate, peak, full_ms[B], cases[0]) for B in batches}
        out["heads"][c.name] = {"spec": c.case.spec, "note": c.case.note, "batches": rows}
        stats = c.head.stats()
        for key in ("active_size", "rank"):
            if key in stats:
                out["heads"][c.name][key] = stats[key]
        if c.head.per_round and "evicted" in stats:  # the steady state really gathered new rows every round
            rounds = len(batches) * (args.repeats + 1)
            out["heads"][c.name]["gathered_per_round"] = (stats["evicted"] - evicted0[c.name]) / rounds
    return out


def _time_batches(cases, batches, d, args, flush, meter, rate, gen, device, deadline) -> list[int]:
    """Time every case at every batch (a warm-up call, then ``args.repeats`` interleaved calls); returns the batches
    skipped past ``deadline``."""
    for c in cases:
        c.timings = {B: [] for B in batches}
    skipped = []
    for B in batches:
        if deadline is not None and B != batches[0] and time.perf_counter() > deadline:
            skipped.append(B)
            continue
        h = torch.randn(B, d, generator=gen).to(device=device, dtype=rate.dtype)
        for c in cases:  # warm-up
            time_case(c, h, args.k, flush, args)
        for c in cases:
            c.rounds.pop(B, None)  # drop the warm-up round
        for _ in range(args.repeats):
            meter.sample()
            rate.sample(B)
            for c in cases:
                c.timings[B].append(time_case(c, h, args.k, flush, args))
    return skipped


def _row(c, B: int, settings, gbps: float, rate, peak: IntPeak | None, full_ms: float, full) -> dict:
    """One head's figures at ``B`` rows: its time, bytes and compute floors, and its ratios to them and to the full
    head's. The compute floor: the integer kernel's multiply-adds at its peak (``peak``), else the FLOPs at the
    in-cache GEMM rate."""
    ms = statistics.median(c.timings[B])
    nbytes = call_bytes(c.head, B, settings)
    floor = nbytes / gbps / 1e6
    flops = call_flops(c.head, B, settings)
    compute = flops / rate.median(B) / 1e6 if peak is None else flops / 2 / peak.gmacs(B) / 1e6
    row = {} if peak is None else {"path": peak.path_at(B), "macs": flops // 2, "peak_GMACs": round(peak.gmacs(B), 1)}
    if c.rounds.get(B):
        obs, first, rest = (statistics.median(x) for x in zip(*c.rounds[B], strict=True))
        row["round_ms"] = {"observe": round(obs, 3), "first_call": round(first, 3), "other_calls": round(rest, 3)}
    return row | {
        "ms": round(ms, 3),
        "ms_min": round(min(c.timings[B]), 3),
        "bytes": nbytes,
        "floor_ms": round(floor, 3),
        "x_floor": round(ms / floor, 2),
        "flops": flops,
        "compute_floor_ms": round(compute, 4),
        "x_compute": round(ms / compute, 2),
        "x_roofline": round(ms / max(floor, compute), 2),
        "achieved_GBps": round(nbytes / ms / 1e6, 2),
        "speedup_vs_full": round(full_ms / ms, 2),
        "bytes_ratio_vs_full": round(call_bytes(full.head, B, settings) / nbytes, 2),
    }


# -- the GEMM itself: which PyTorch call gets closest to the floor on this CPU -------------------
@torch.inference_mode()
def gemm_variants(
    d: int, n: int, batches: list[int], dtype: torch.dtype, args, flush: Flusher, meter: CopyMeter
) -> dict:
    """Candidate ways to compute h @ W.T for W [n, d], each timed cold (median of repeats)."""
    gen = torch.Generator().manual_seed(args.seed)
    W = (torch.randn(n, d, generator=gen) * 0.02).to(dtype)
    Wt = W.T.contiguous()
    e = W.element_size()
    out = {"rows": n, "d": d, "dtype": str(dtype).removeprefix("torch."), "batches": {}}
    for B in batches:
        h = torch.randn(B, d, generator=gen).to(dtype)
        variants: dict[str, Callable[[], object]] = {
            "F.linear(h, W)": lambda h=h: F.linear(h, W),
            "h @ W.T": lambda h=h: h @ W.T,
            "torch.matmul(h, W.T)": lambda h=h: torch.matmul(h, W.T),
            "h @ Wt (packed [d, n])": lambda h=h: h @ Wt,
            "(W @ h.T).T": lambda h=h: (W @ h.T).T,
        }
        if dtype != torch.float32:  # oneDNN's bf16 kernels already accumulate in fp32; these test fp32 math
            Wf = W.float()
            variants["F.linear fp32 (W kept in fp32: 2x bytes)"] = lambda h=h, Wf=Wf: F.linear(h.float(), Wf)
            variants["F.linear fp32 (W upcast per call)"] = lambda h=h: F.linear(h.float(), W.float())
        try:  # oneDNN's prepacked (VNNI-blocked) weight, what torch.compile's CPU freezing uses
            Wp = torch.ops.mkldnn._reorder_linear_weight(W, B)
            variants["mkldnn prepacked linear"] = lambda h=h, Wp=Wp: torch.ops.mkldnn._linear_pointwise(
                h, Wp, None, "none", [], ""
            )
        except (RuntimeError, AttributeError) as ex:
            out.setdefault("unavailable", {})["mkldnn prepacked linear"] = str(ex).splitlines()[0][:200]
        if kernels.supports(W):  # spechead's own few-row kernel on its blocked layout (kernels.py)
            Wb = BlockedWeight(W)
            variants["spechead kernel (blocked)"] = lambda h=h, Wb=Wb: Wb(h)
        else:
            out.setdefault("unavailable", {})["spechead kernel (blocked)"] = kernels.unavailable_reason()
        ts: dict[str, list[float]] = {name: [] for name in variants}
        meter.samples.clear()
        for fn in variants.values():
            fn()
        for _ in range(args.repeats):  # interleaved, next to a copy-bandwidth sample
            meter.sample()
            for name, fn in variants.items():
                flush()
                t0 = time.perf_counter()
                fn()
                ts[name].append((time.perf_counter() - t0) * 1e3)
        floor = (n * d * e + B * n * e) / meter.median() / 1e6
        res = {}
        for name, samples in ts.items():
            ms = statistics.median(samples)
            res[name] = {
                "ms": round(ms, 3),
                "x_floor": round(ms / floor, 2),
                "GFLOPs": round(2 * B * n * d / ms / 1e6, 1),
            }
        out["batches"][str(B)] = {"floor_ms": round(floor, 3), "variants": res}
    return out


def cpu_bars(report: dict) -> dict:
    """The head bars at llama3.1-8b in bf16: at batch 10, NanoSpec:3072 >= 25x faster than the full head and the
    rank-512 low-rank head >= 4x; every head within 1.5x of its own bytes-moved floor at batch 1, and at batch 10
    within 2x (the bar for a build with wide vectors) and 2.5x (the bar every kernel build, AVX2 included, meets)."""
    res = report["shapes"].get("llama3.1-8b")
    if res is None or res["dtype"] != "bf16":
        return {}
    heads = res["heads"]
    bars = {}
    if "10" in heads["full"]["batches"]:
        for name, want in (("nanospec:3072", 25.0), ("lowrank:512", 4.0)):
            if name in heads:
                v = heads[name]["batches"]["10"]["speedup_vs_full"]
                bars[f"{name} speedup vs full"] = {"value": v, "want": f">= {want}", "pass": v >= want}
    for batch, want in (("1", 1.5), ("10", 2.0), ("10", 2.5)):
        for name, h in heads.items():
            if batch in h["batches"]:
                v = h["batches"][batch]["x_floor"]
                key = f"{name} batch {batch} time <= {want}x bytes floor"
                bars[key] = {"value": v, "want": f"<= {want}", "pass": v <= want}
    return bars
