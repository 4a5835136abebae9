"""The attention kernel (`attend`) against torch's SDPA for 1-64 query rows of the demo target's shape (9 query
heads, 3 key/value heads, head size 64) over 600 cached slots, hot caches, medians of 200 calls.

    .venv/bin/python results/bench/zen3/attend_micro.py --threads 2
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from spechead import kernels
from spechead.tuning.measure import cpu_name

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
op = kernels.ops().attend
N, KV, D, L, start = 9, 3, 64, 2048, 600


def median_us(fn, *a, **kw) -> float:
    for _ in range(20):
        fn(*a, **kw)
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        fn(*a, **kw)
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


print(f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, build {kernels.active_isa()}, {args.threads} threads")
for T in (1, 4, 16, 64):
    q, k, v = torch.randn(T, N * D), torch.randn(T, KV * D), torch.randn(T, KV * D)
    cos, sin = torch.randn(T, D), torch.randn(T, D)
    kc, vc = torch.randn(1, KV, L, D), torch.randn(1, KV, L, D)
    ours = median_us(op, q, k, v, cos, sin, kc, vc, 0, start, None, 0, 0.125)
    qq, kk, vv = torch.randn(1, N, T, D), kc[:, :, : start + T], vc[:, :, : start + T]
    mask = torch.ones(T, start + T, dtype=torch.bool).tril(start) if T > 1 else None
    sdpa = median_us(F.scaled_dot_product_attention, qq, kk, vv, attn_mask=mask, enable_gqa=True)
    print(f"{T:3d} rows: attend {ours:8.1f} us, SDPA {sdpa:8.1f} us")
