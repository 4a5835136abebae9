"""The few-row GEMM of two kernel sources, built side by side for one ISA under their own op namespaces: bitwise
equality of every product, then the time of the demo target's 121 weights in turn (cold: 538 MB, as a decode
step or a verification reads them), interleaved, median of repeats, 2 threads.

    python results/bench/zen3/kernel_compare.py --base 51dbddf --isa avx2
"""

import argparse
import statistics
import time

import torch
from two_builds import build_pair  # beside this script

from spechead.kernels import _ISA_FLAGS
from spechead.kernels.linear import BlockedWeight
from spechead.tuning.measure import cpu_name

p = argparse.ArgumentParser()
p.add_argument("--base", required=True, help="git revision whose kernel source is the baseline")
p.add_argument("--isa", default="avx2", choices=sorted(_ISA_FLAGS))
p.add_argument("--rows", default="1,4,8,10,12,16,64")
p.add_argument("--repeats", type=int, default=5)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
ops = {tag: lib.draft_linear for tag, lib in build_pair(args.base, args.isa, "kcmp").items()}
print(
    f"{cpu_name()}, torch capability {torch.backends.cpu.get_cpu_capability()}, build {args.isa}, "
    f"{args.threads} threads; base {args.base} vs the working tree"
)
g = torch.Generator().manual_seed(0)
shapes = [(576, 576), (960, 576), (576, 1536), (3072, 576)] * 30 + [(49152, 576)]  # the demo target, fused
for dt in (torch.float32, torch.bfloat16):
    ws = [BlockedWeight(torch.randn(n, k, generator=g).to(dt)).data for n, k in shapes]
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        for w, (n, k) in list(zip(ws[:4], shapes[:4], strict=True)) + [(ws[-1], shapes[-1])]:
            assert torch.equal(ops["base"](xs[k], w, w.shape[0]), ops["new"](xs[k], w, w.shape[0])), (dt, m, n, k)
        times: dict[str, list[float]] = {"base": [], "new": []}
        for _ in range(args.repeats):
            for name, op in ops.items():
                t0 = time.perf_counter()
                for w, (_, k) in zip(ws, shapes, strict=True):
                    op(xs[k], w, w.shape[0])
                times[name].append(time.perf_counter() - t0)
        b, n_ = (1e3 * statistics.median(times[k]) for k in ("base", "new"))
        print(
            f"{str(dt)[6:]:8s} rows {m:3d}: base {b:6.1f} ms, new {n_:6.1f} ms, new/base {n_ / b:.2f}, bitwise equal",
            flush=True,
        )
