"""Cost of one target forward over T rows (tree verification) against a one-token decode step, with the
weights used as is and laid out by ``Transformer.prepack`` (spechead's draft-GEMM kernel where it runs,
else MKL packing at T), demo target, fp32. "x_decode_step" divides by the plain one-row step; the
prepacked one-row step is in "ms" too.

    python results/bench/verify-cost/measure.py --threads 2 --out results/bench/verify-cost/t2.json
"""

import argparse
import json
import os
import platform
import statistics
import time

import torch

from spechead import kernels
from spechead.decoding.session import Session

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,2,4,8,16")
p.add_argument("--context", type=int, default=600, help="tokens already in the cache")
p.add_argument("--repeats", type=int, default=9)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
rows = [int(r) for r in args.rows.split(",")]
ctx = args.context


def measure(model) -> dict[int, float]:
    ids = torch.randint(0, 40000, (ctx + max(rows),), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.inference_mode():
        model(ids[:ctx], 0, logits_rows=None)
        for t in rows:
            times = []
            for r in range(args.repeats + 2):
                t0 = time.perf_counter()
                model(ids[ctx : ctx + t], ctx)
                if r >= 2:  # warm-up
                    times.append(time.perf_counter() - t0)
            out[t] = round(1000 * statistics.median(times), 2)
    return out


plain = measure(Session.open("demo", 2048).target)
packed = {}
for t in rows:
    model = Session.open("demo", 2048).target  # a fresh copy per size: one packed copy at a time
    packed[t] = measure(model)[t] if model.prepack(t) else None
step = plain[1]
result = {
    "command": "python results/bench/verify-cost/measure.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
    "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "loadavg": os.getloadavg()},
    "context_tokens": ctx,
    "prepack": "spechead kernel" if kernels.available() else "MKL packing at each row count",
    "ms": {"plain": plain, "packed": packed},
    "x_decode_step": {
        "plain": {t: round(v / step, 2) for t, v in plain.items()},
        "packed": {t: (round(v / step, 2) if v else None) for t, v in packed.items()},
    },
    # what the engine pays now: decode steps are prepacked too, so verification vs a prepacked step
    "x_prepacked_step": {t: (round(v / packed[1], 2) if v and packed.get(1) else None) for t, v in packed.items()},
}
print(json.dumps(result, indent=1))
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
