"""A verification's floor on this CPU: the few-row GEMM over the demo target's 121 weights (fp32, 538 MB, cold as a
decode step reads them) at 1-16 rows, with each kernel build the CPU runs, beside torch's (MKL's) large sgemm as the
measured compute peak. A 16-row verification cannot cost less than max(bytes at the read bandwidth, its FLOPs at that
peak): issue 12 asks for 1.4x a decode step, which on 2 cores is the compute floor itself.

    .venv/bin/python results/bench/portable/s25/isa_rows.py [--rows 1,4,8,12,16] [--repeats 7]
"""

import argparse
import statistics
import time

import torch

from spechead.kernels import host_isas, library
from spechead.kernels.linear import LANES
from spechead.tuning.measure import cpu_name

p = argparse.ArgumentParser()
p.add_argument("--rows", default="1,4,8,12,16")
p.add_argument("--repeats", type=int, default=7)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)

a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
for _ in range(3):
    a @ b
t = time.perf_counter()
for _ in range(10):
    a @ b
peak = 2 * 2048**3 / ((time.perf_counter() - t) / 10) / 1e9
cap = torch.backends.cpu.get_cpu_capability()
print(f"{cpu_name()} ({cap}), {args.threads} threads; sgemm 2048^3 {peak:.0f} GFLOP/s")

# the demo target's shapes (SmolLM2-135M: 30 layers of q, k, v, o, gate, up, down; the tied head), random values
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = []
for n, k in shapes:  # the kernel's fp32 layout [N/16][K][16]
    w = torch.randn(n, k) * 0.02
    weights.append(w.view(n // LANES, LANES, k).permute(0, 2, 1).contiguous())
nbytes = sum(w.numel() * 4 for w in weights)
flops_per_row = 2 * nbytes / 4
for isa in host_isas():
    ops = library(isa)
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for w in weights:
                ops.draft_linear(xs[w.shape[1]], w, w.shape[0])
            times.append(time.perf_counter() - t)
        s, flops = statistics.median(times), m * flops_per_row
        print(
            f"{isa:8s} rows {m:2d}: {s * 1e3:6.2f} ms  {nbytes / s / 1e9:5.1f} GB/s  {flops / s / 1e9:6.1f} GFLOP/s  "
            f"(compute floor at the sgemm peak {flops / peak / 1e6:5.2f} ms)"
        )
