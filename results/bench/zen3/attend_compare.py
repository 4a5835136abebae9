"""The attention op of two kernel sources, built side by side for one ISA under their own op namespaces: bitwise
equality of every output, then the time of one request's T rows (a chain under a tree mask, 600 cached slots)
over 30 layers' cache lanes, cold (a 64 MB sweep before each pass, as a forward's weights leave them) and hot, and
of 16 one-row requests on 16 lanes (300 slots each) through a whole layer op, base and new interleaved pass by
pass, medians; 2 threads.

    .venv/bin/python results/bench/zen3/attend_compare.py --base 302f517 --isa avx2
"""

import argparse
import statistics
import time

import torch
from two_builds import build_pair  # beside this script

from spechead.kernels import _ISA_FLAGS
from spechead.kernels.linear import BlockedWeight
from spechead.model.layers import Rotary
from spechead.tuning.measure import cpu_name

p = argparse.ArgumentParser()
p.add_argument("--base", required=True, help="git revision whose kernel source is the baseline")
p.add_argument("--isa", default="avx2", choices=sorted(_ISA_FLAGS))
p.add_argument("--repeats", type=int, default=31)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
libs = build_pair(args.base, args.isa, "acmp")
print(f"{cpu_name()}, torch capability {torch.backends.cpu.get_cpu_capability()}, build {args.isa}, "
      f"{args.threads} threads; base {args.base} vs the working tree")  # fmt: skip
g = torch.Generator().manual_seed(0)
N, KV, D, ctx, layers = 9, 3, 64, 600, 30
rotary = Rotary(D, 4096, 10000.0)
sweep = torch.ones(16 * 2**20)


def timed(calls: dict, cold: bool) -> dict[str, float]:
    """Median us a layer of each variant's pass over the layers, the variants interleaved pass by pass."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(args.repeats + 2):
        for name, fn in calls.items():
            if cold:
                sweep.mul_(1.0)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: round(1e6 * statistics.median(v[2:]) / layers, 1) for k, v in times.items()}


caches = [(torch.randn(1, KV, 2048, D, generator=g), torch.randn(1, KV, 2048, D, generator=g)) for _ in range(layers)]
for T in (1, 4, 8, 16):
    q, k, v = (torch.randn(T, n * D, generator=g) for n in (N, KV, KV))
    cos, sin = (c.contiguous() for c in rotary(torch.arange(ctx, ctx + T)))
    mask = torch.ones(T, ctx + T, dtype=torch.bool)
    mask[:, ctx:] = torch.ones(T, T, dtype=torch.bool).tril()
    m = mask if T > 1 else None
    outs = {n: lib.attend(q, k, v, cos, sin, *caches[0], 0, ctx, m, 0, 0.125) for n, lib in libs.items()}
    same = torch.equal(outs["base"], outs["new"])

    def run(lib, q=q, k=k, v=v, cos=cos, sin=sin, m=m):
        return lambda: [lib.attend(q, k, v, cos, sin, kc, vc, 0, ctx, m, 0, 0.125) for kc, vc in caches]

    calls = {n: run(lib) for n, lib in libs.items()}
    cold, hot = timed(calls, True), timed(calls, False)
    print(f"attend, {T:2d} rows: bitwise equal {same}; us a layer cold {cold}, hot {hot}")

# a layer op over 16 one-row requests (a batch of decode steps), the demo target's shapes, random weights
d, inter, B, start = 576, 1536, 16, 300
widths = [(N + 2 * KV) * D, d, 2 * inter, d]
fan_in = [d, N * D, d, inter]
ws = [BlockedWeight(torch.randn(n, kk, generator=g) / kk**0.5).data for n, kk in zip(widths, fan_in, strict=True)]
ln = torch.ones(d)
lanes = [(torch.randn(B, KV, 1024, D, generator=g), torch.randn(B, KV, 1024, D, generator=g)) for _ in range(layers)]
x = torch.randn(B, d, generator=g)
cos, sin = (c.contiguous() for c in rotary(torch.full((B,), start)))
rows = (list(range(B)), [1] * B, list(range(B)), [start] * B, [None] * B, [0] * B)
outs = {n: lib.llama_layer(x, ln, ln, 1e-5, *ws, widths, cos, sin, *lanes[0], *rows, 0.125) for n, lib in libs.items()}


def run_layer(lib):
    return lambda: [lib.llama_layer(x, ln, ln, 1e-5, *ws, widths, cos, sin, kc, vc, *rows, 0.125) for kc, vc in lanes]


calls = {n: run_layer(lib) for n, lib in libs.items()}
print(f"llama_layer, {B} one-row requests: bitwise equal {torch.equal(outs['base'], outs['new'])}; "
      f"us a layer cold {timed(calls, True)}")  # fmt: skip

# the same layer op over one request: a decode step (1 row, 600 slots) and an 8-row chain
one_lane = [(torch.randn(1, KV, 1024, D, generator=g), torch.randn(1, KV, 1024, D, generator=g)) for _ in range(layers)]
for T in (1, 8):
    x1 = torch.randn(T, d, generator=g)
    c1, s1 = (c.contiguous() for c in rotary(torch.arange(ctx, ctx + T)))
    chain = torch.ones(T, ctx + T, dtype=torch.bool).tril(ctx) if T > 1 else None
    rows1 = ([0], [T], [0], [ctx], [chain], [0])
    args1 = (ln, ln, 1e-5, *ws, widths, c1, s1)
    outs = {n: lib.llama_layer(x1, *args1, *one_lane[0], *rows1, 0.125) for n, lib in libs.items()}

    def run_one(lib, x1=x1, args1=args1, rows1=rows1):
        return lambda: [lib.llama_layer(x1, *args1, kc, vc, *rows1, 0.125) for kc, vc in one_lane]

    calls = {n: run_one(lib) for n, lib in libs.items()}
    print(f"llama_layer, one request of {T} rows: bitwise equal {torch.equal(outs['base'], outs['new'])}; "
          f"us a layer cold {timed(calls, True)}")  # fmt: skip

# SiLU(gate) x up over 1 and 16 rows of the demo target's MLP (30 calls a pass, hot)
for R in (1, 16):
    gu = torch.randn(R, 2 * inter, generator=g) * 3
    same = torch.equal(libs["base"].silu_mul(gu), libs["new"].silu_mul(gu))
    calls = {n: (lambda lib=lib, gu=gu: [lib.silu_mul(gu) for _ in range(layers)]) for n, lib in libs.items()}
    print(f"silu_mul, {R:2d} rows: bitwise equal {same}; us a call {timed(calls, False)}")
