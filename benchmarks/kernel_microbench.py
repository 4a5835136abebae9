"""Microbenchmarks behind docs/kernels.md: this CPU's large-GEMM rate in bf16 and fp32 (why a 10-row bf16 GEMM
is compute-bound with oneDNN where the bf16 dot product runs at half the fp32 FMA rate), and the top-k /
reduction costs over an EAGLE-2 tree's target logits ([60, 128256] bf16) that the ``row_topk`` kernel replaces.
Hot caches, medians; prints the JSON it writes.

    .venv/bin/python benchmarks/kernel_microbench.py --threads 2 --out runs/kernel_microbench.json
"""

import argparse
import json
import os

import torch

from spechead import kernels
from spechead.heads import base as heads
from spechead.tuning.measure import median_ms

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--repeats", type=int, default=20)
p.add_argument("--out", required=True, help="JSON file to write")
args = p.parse_args()
torch.set_num_threads(args.threads)


def med_ms(fn, repeats=args.repeats) -> float:
    return round(median_ms(fn, repeats), 3)


def chunked_topk(x, k):
    """heads.fast_topk with the kernel switched off: its two-stage chunked top-k."""
    supported, heads.row_topk_supported = heads.row_topk_supported, lambda x, k: False
    try:
        return heads.fast_topk(x, k)
    finally:
        heads.row_topk_supported = supported


g = torch.Generator().manual_seed(0)
res: dict = {"threads": args.threads, "loadavg": os.getloadavg(), "kernel": kernels.available()}
a, b = torch.randn(512, 4096, generator=g), torch.randn(4096, 4096, generator=g)
for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    x, y = a.to(dt), b.to(dt)
    ms = med_ms(lambda x=x, y=y: x @ y, 5)
    res[f"gemm_512x4096x4096_{name}_GFLOPs"] = round(2 * 512 * 4096 * 4096 / ms / 1e6, 1)
logits = torch.randn(60, 128256, generator=g).bfloat16()
res["topk3_60x128256_bf16_ms"] = {
    "row_topk (spechead kernel)": med_ms(lambda: kernels.row_topk(logits, 3)) if kernels.available() else None,
    "chunked fast_topk (the fallback)": med_ms(lambda: chunked_topk(logits, 3)),
    "Tensor.topk": med_ms(lambda: logits.topk(3, dim=-1)),
}
logits_fp32 = logits.float()
# the fallback's own cost, without the kernel: the chunk-max step it spends most of its time in
res["amax_chunks128_60x128256_ms"] = {
    "bf16": med_ms(lambda: logits.view(60, -1, 128).amax(-1)),
    "fp32": med_ms(lambda: logits_fp32.view(60, -1, 128).amax(-1)),
}
print(json.dumps(res, indent=1))
with open(args.out, "w") as f:
    json.dump(res, f, indent=1)
