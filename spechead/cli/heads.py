"""``spechead bench-heads``: every registered draft head at a real model's (d, V), random weights, one run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from spechead import kernels
from spechead.bench.heads import (
    DTYPE_NAMES,
    DTYPES,
    SHAPES,
    Flusher,
    bench_shape,
    copy_meter,
    cpu_bars,
    gemm_variants,
)
from spechead.cli.args import add_threads, positive_int
from spechead.errors import SpecheadError
from spechead.model.lowrank import default_rank
from spechead.tuning.measure import cpu_name, llc_bytes


def _ints(spec: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SpecheadError(f"{what} must be comma-separated integers, got {spec!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise SpecheadError(f"{what} must be positive integers, got {spec!r}")
    return vals


def print_table(res: dict) -> None:
    print(f"\n{res['shape']}: d={res['d']} V={res['V']} {res['dtype']}, copy {res['copy_GBps']} GB/s during the run")
    print("in-cache GEMM GFLOP/s by batch: " + ", ".join(f"{b}: {v}" for b, v in res["gemm_GFLOPs_in_cache"].items()))
    ik = res.get("int_kernel")
    if ik:
        below = {k: v for k, v in ik.items() if k.startswith("path_below")}
        print(
            f"integer kernel path {ik['path']}"
            + "".join(f" ({v} {k.removeprefix('path_').replace('_', ' ')})" for k, v in below.items())
            + f": compute floor at {ik['macs_per_cycle_per_core']} int8 MACs/cycle/core x {ik['clock_MHz']} MHz"
            f" ({ik['clock_source']}) x {ik['threads']} threads = {ik['peak_GMACs']} GMAC/s"
        )
    print(f"compute floor: {res['compute_floor']}; bytes floor: bytes moved at the copy bandwidth")
    print(
        f"{'head':<18}{'batch':>6}{'ms':>10}{'floor ms':>10}{'comp ms':>9}{'x floor':>9}{'x comp':>8}{'x roof':>8}"
        f"{'GB/s':>8}{'vs full':>9}{'bytes x':>9}" + (f"{'path':>13}" if ik else "")
    )
    for name, hres in res["heads"].items():
        for B, r in hres["batches"].items():
            print(
                f"{name:<18}{B:>6}{r['ms']:>10.2f}{r['floor_ms']:>10.2f}{r['compute_floor_ms']:>9.3f}"
                f"{r['x_floor']:>9.2f}{r['x_compute']:>8.2f}{r['x_roofline']:>8.2f}"
                f"{r['achieved_GBps']:>8.1f}{r['speedup_vs_full']:>9.2f}{r['bytes_ratio_vs_full']:>9.2f}"
                + (f"{r['path']:>13}" if ik else "")
            )
    for name, why in res["skipped"].items():
        print(f"{name:<18} skipped: {why}")


def device_of(spec: str) -> torch.device:
    """``cpu`` or ``cuda[:N]``, refused when torch sees no such device."""
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise SpecheadError(f"--device must be cpu or cuda[:N], got {spec!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise SpecheadError(f"--device must be cpu or cuda[:N], got {spec!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecheadError("--device cuda: torch sees no CUDA device")
    return device


def draft_gemm(device: torch.device) -> str:
    """What computes the heads' products: spechead's CPU kernel where it runs, else ``F.linear`` (on a GPU the CPU
    kernels are not even built)."""
    if device.type != "cpu":
        return f"F.linear on {device.type}"
    if kernels.available():
        return f"spechead kernel ({kernels.active_isa()})"
    return f"fallback: {kernels.unavailable_reason()}"


def checked_args(args, device: torch.device) -> tuple[list[str], list[int]]:
    """The shapes and batches asked for, once every option is checked (a bad one raises SpecheadError)."""
    if args.gemm_variants and device.type != "cpu":
        raise SpecheadError("--gemm-variants compares the CPU's GEMM paths: run it with --device cpu")
    shapes = [s for s in args.shape.split(",") if s]
    for s in shapes:
        if s not in SHAPES:
            raise SpecheadError(f"unknown shape {s!r}; expected one of {', '.join(SHAPES)}")
    if args.dtype not in DTYPE_NAMES:
        raise SpecheadError(f"unknown dtype {args.dtype!r}; expected one of {', '.join(DTYPE_NAMES)}")
    if args.dtype not in DTYPES and device.type != "cpu":
        raise SpecheadError(f"--dtype {args.dtype} runs spechead's integer kernel: run it with --device cpu")
    if args.dtype not in DTYPES and args.gemm_variants:
        raise SpecheadError(f"--gemm-variants compares float GEMM calls: not with --dtype {args.dtype}")
    for s in shapes:  # a head skipped for an option the shape cannot take would hide the user's mistake
        if args.rank is not None and args.rank >= SHAPES[s][0]:
            raise SpecheadError(f"--rank must be below the hidden size of {s} ({SHAPES[s][0]}), got {args.rank}")
    batches = _ints(args.batch, "--batch")
    if args.new_per_round > args.nodes:
        raise SpecheadError("--new-per-round cannot exceed --nodes (new ids enter through the nodes' top-k)")
    return shapes, batches


def cmd_bench_heads(args) -> int:
    device = device_of(args.device)
    shapes, batches = checked_args(args, device)
    flush = Flusher(args.hot, device)
    meter = copy_meter(device)
    bw = meter.start()
    cache = "L2" if device.type == "cuda" else "LLC"
    load0 = os.getloadavg()
    report = {
        "config": {
            "command": "spechead " + " ".join(sys.argv[1:]),
            "threads": torch.get_num_threads(),
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "llc_MB": llc_bytes() / 2**20,
            "torch": torch.__version__,
            "draft_gemm": draft_gemm(device),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cache": "hot" if args.hot else f"cold ({cache} flushed before every call)",
            "repeats": args.repeats,
            "k": args.k,
            "calls_per_round": args.calls_per_round,
            "new_per_round": args.new_per_round,
            "tree_nodes": args.nodes,
            "loadavg_start": [round(x, 2) for x in load0],
        },
        "machine": {k: round(v, 2) for k, v in bw.items()},
        "shapes": {},
    }
    where = f"{report['config']['device']}; " if device.type == "cuda" else ""
    print(
        f"{where}{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}); kernels: {report['config']['draft_gemm']}; "
        f"copy bandwidth {bw['copy_GBps']:.1f} GB/s (read {bw['read_GBps']:.1f}); {torch.get_num_threads()} threads"
    )
    for s in shapes:
        meter.samples.clear()
        res = bench_shape(s, batches, args.dtype, args, flush, meter, device)
        res["shape"] = s
        report["shapes"][s] = res
        print_table(res)
        if args.gemm_variants:
            d, V = SHAPES[s]
            r = args.rank or default_rank(d)
            report["shapes"][s]["gemm_variants"] = gvs = [
                gemm_variants(d, min(args.gemm_rows, V), batches, DTYPES[args.dtype], args, flush, meter),
                gemm_variants(r, V, batches, DTYPES[args.dtype], args, flush, meter),  # the low-rank head's W_up
            ]
            for gv in gvs:
                for B, row in gv["batches"].items():
                    print(f"  GEMM [{gv['rows']}, {gv['d']}] batch {B} (floor {row['floor_ms']:.2f} ms):")
                    for name, v in row["variants"].items():
                        print(f"    {name:<42}{v['ms']:>9.2f} ms {v['x_floor']:>7.2f}x floor {v['GFLOPs']:>7.1f} GF/s")
    report["config"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    bars = cpu_bars(report) if device.type == "cpu" else {}
    if bars:
        report["bars"] = bars
        for name, b in bars.items():
            print(f"bar {name}: {b['value']} (want {b['want']}): {'PASS' if b['pass'] else 'FAIL'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench-heads", help="time every draft head at a real model's shape (random weights)")
    p.add_argument("--shape", default="llama3.1-8b", help=f"one or more of {', '.join(SHAPES)}, comma-separated")
    p.add_argument("--batch", default="1,10,64", help="rows per draft call, comma-separated")
    p.add_argument(
        "--dtype", default="bf16", help="bf16, fp16, fp32, or q8 / q4 (32-value integer blocks on the integer kernel)"
    )
    p.add_argument("--repeats", type=positive_int, default=10)
    p.add_argument("--k", type=positive_int, default=10, help="top-k per call")
    p.add_argument("--subset", type=positive_int, default=32768, help="size of the fr / vocabtrim subsets")
    p.add_argument("--w-max", type=positive_int, default=3072, help="NanoSpec / hybrid W_max")
    p.add_argument("--rank", type=positive_int, default=None, help="low-rank head rank (default d/8)")
    p.add_argument(
        "--calls-per-round", type=positive_int, default=6, help="draft calls per round (EAGLE-2 depth 5 + root)"
    )
    p.add_argument(
        "--new-per-round", type=positive_int, default=16, help="fresh ids gathered into NanoSpec's set per round"
    )
    p.add_argument(
        "--nodes", type=positive_int, default=60, help="tree nodes verified per round (their logits feed Ext)"
    )
    p.add_argument("--hot", action="store_true", help="do not flush the caches between calls")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the heads run (cuda flushes its L2)")
    p.add_argument("--gemm-variants", action="store_true", help="also time alternative GEMM calls")
    p.add_argument("--gemm-rows", type=positive_int, default=32768, help="rows of the matrix for --gemm-variants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    add_threads(p)
    p.set_defaults(func=cmd_bench_heads)
