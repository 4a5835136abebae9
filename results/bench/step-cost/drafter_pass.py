"""The demo drafter's pass as a round sees it: right after a target decode step (which streams the target's 537 MB
through the caches), on F.linear (MKL's sgemm: how drafters ran until the twenty-second session) and laid out for
spechead's few-row kernel (``Drafter.prepack``), interleaved in one process: plain, laid out, plain ... on the same
weights, inputs and cache, so that the host's drift falls on both alike.

The floor is the drafter's weight bytes at the read bandwidth measured next to the runs (the pass's attention over
``--context`` slots and its embedding rows add a little more).

    .venv/bin/python results/bench/step-cost/drafter_pass.py --threads 2 \
        --out results/bench/portable/s22/drafter_pass.json
"""

import argparse
import json
import statistics
import time

import torch

from spechead.decoding.session import Session, resolve_drafter
from spechead.tuning.measure import CopyMeter, machine_facts

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,2,4,8")
p.add_argument("--context", type=int, default=600, help="pairs already in the drafter's cache")
p.add_argument("--repeats", type=int, default=31)
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
rows = [int(r) for r in args.rows.split(",")]
session = Session.open("demo", max_len=2048)
target, ctx = session.target, args.context
drafters = {"F.linear": resolve_drafter("demo", target), "kernel": resolve_drafter("demo", target)}
target.prepack(1)
for d in drafters.values():
    d.setup_cache(2048)
assert drafters["kernel"].prepack(max(rows)), "no layout applies on this machine"
d_model = target.config.hidden_size
weight_bytes = sum(p.numel() * p.element_size() for p in drafters["F.linear"].parameters())
g = torch.Generator().manual_seed(0)
vocab = target.config.vocab_size
inputs = {r: (torch.randint(0, vocab, (r,), generator=g), torch.randn(r, d_model, generator=g)) for r in rows}
one = torch.tensor([1])
meter = CopyMeter()
bandwidth = meter.start()
times: dict[str, dict[int, list[float]]] = {k: {r: [] for r in rows} for k in drafters}
with torch.inference_mode():
    target(torch.arange(ctx) % 1000, 0)  # a context in the target's cache
    for rep in range(args.repeats + 1):
        for r, (tokens, feats) in inputs.items():
            for name, d in drafters.items():
                target(one, ctx)  # what precedes a drafter pass in a round: the target's forward
                t0 = time.perf_counter()
                d(tokens, feats, ctx, torch.arange(ctx, ctx + r), None)
                if rep:  # the first sweep warms up
                    times[name][r].append(1e3 * (time.perf_counter() - t0))
        meter.sample()
read = bandwidth["read_GBps"]
floor_ms = weight_bytes / read / 1e6
out = {
    "machine": machine_facts(args.threads),
    "bandwidth": bandwidth,
    "copy_GBps_between_sweeps": meter.median(),  # the drift during the runs, against bandwidth's copy_GBps
    "drafter_weight_MB": weight_bytes / 1e6,
    "floor_ms": floor_ms,
    "context": ctx,
    "repeats": args.repeats,
    "median_ms": {k: {r: statistics.median(v) for r, v in per.items()} for k, per in times.items()},
}
with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
print(
    f"{out['machine']['cpu']} ({out['machine']['capability']}), {args.threads} threads; read {read:.1f} GB/s, "
    f"copy {bandwidth['copy_GBps']:.1f} GB/s before the runs and {meter.median():.1f} between sweeps"
)
print(f"drafter weights {weight_bytes / 1e6:.1f} MB: floor {floor_ms:.2f} ms a pass")
for r in rows:
    a, b = out["median_ms"]["F.linear"][r], out["median_ms"]["kernel"][r]
    print(f"{r:>2} rows: F.linear {a:.2f} ms, kernel {b:.2f} ms ({b / a:.2f}x; {b / floor_ms:.2f}x the floor)")
