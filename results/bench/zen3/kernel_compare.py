"""The few-row GEMM of two kernel sources, built side by side for one ISA under their own op namespaces: bitwise
equality of every product, then the time of the demo target's 121 weights in turn (cold: 538 MB, as a decode
step or a verification reads them), interleaved, median of repeats, 2 threads.

    python results/bench/zen3/kernel_compare.py --base 51dbddf --isa avx2
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time

import torch
from torch.utils.cpp_extension import load

from spechead.kernels import _COMMON_FLAGS, _ISA_FLAGS, SOURCE
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
work = tempfile.mkdtemp(prefix="spechead-kcmp-")
base_src = os.path.join(work, "base.cpp")
with open(base_src, "w") as f:
    f.write(subprocess.check_output(["git", "show", f"{args.base}:spechead/kernels/csrc/draft_gemm.cpp"], text=True))


def build(tag: str, src: str):
    os.makedirs(os.path.join(work, tag))
    flags = [*_COMMON_FLAGS, *_ISA_FLAGS[args.isa], f"-DSPECHEAD_NS=kcmp_{tag}"]
    load(
        name=f"kcmp_{tag}",
        sources=[src],
        extra_cflags=flags,
        extra_ldflags=["-fopenmp"],
        build_directory=os.path.join(work, tag),
        is_python_module=False,
    )
    return getattr(torch.ops, f"kcmp_{tag}").draft_linear


ops = {"base": build("base", base_src), "new": build("new", str(SOURCE))}
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
