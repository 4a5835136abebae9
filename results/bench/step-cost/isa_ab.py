"""The demo target's step (1 row) and verifications (several rows) on every kernel build this CPU runs, interleaved
in one process: build A, build B, A, B ... on the same weights, cache and inputs, so that the host's drift (which moves
the per-build runs of measure.py by up to 1.3x between minutes on a shared VM) falls on both builds alike.

Why: on an AMD EPYC Zen 4 (AVX-512 executed as two 256-bit halves) the widest build is not obviously the fastest;
this says, per row count, which build is and by how much. Each build's outputs are checked bitwise against the
first's in passing (the kernels promise the same accumulation order only within a build, so a difference is
reported, not fatal).

    .venv/bin/python results/bench/step-cost/isa_ab.py --threads 2 --out results/bench/portable/s21/isa_ab.json
"""

import argparse
import json
import statistics
import time

import torch

from spechead import kernels
from spechead.decoding.session import Session
from spechead.tuning.measure import machine_facts

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,4,8,16")
p.add_argument("--context", type=int, default=600, help="tokens already in the cache")
p.add_argument("--repeats", type=int, default=21)
p.add_argument("--isas", default=None, help="builds to compare (default: every one the CPU runs but generic)")
p.add_argument("--out", required=True)
args = p.parse_args()
torch.set_num_threads(args.threads)
rows = [int(r) for r in args.rows.split(",")]
isas = args.isas.split(",") if args.isas else [i for i in kernels.host_isas() if i != "generic"]
ctx = args.context
libs = {isa: kernels.library(isa) for isa in isas}
bad = {isa: lib for isa, lib in libs.items() if isinstance(lib, str)}
if bad:
    raise SystemExit(f"builds unavailable: {bad}")


def use(isa: str) -> None:
    kernels.active_isa()  # let the library pick first, then override its choice for this repeat
    kernels._state.update(isa=isa, ops=libs[isa], why="")


model = Session.open("demo", 2048).target
model.prepack(max(rows))
ids = torch.randint(0, 40000, (ctx + max(rows),), generator=torch.Generator().manual_seed(0))
times: dict[str, dict[int, list[float]]] = {isa: {t: [] for t in rows} for isa in isas}
same: dict[str, dict[int, bool]] = {isa: {} for isa in isas}
with torch.inference_mode():
    use(isas[0])
    model(ids[:ctx], 0, logits_rows=None)
    for t in rows:
        mask = torch.ones(t, ctx + t, dtype=torch.bool)
        mask[:, ctx:] = torch.ones(t, t, dtype=torch.bool).tril()  # a chain: the tree mask's densest case
        pos = torch.arange(ctx, ctx + t)
        first = None
        for r in range(args.repeats + 2):
            for isa in isas if r % 2 == 0 else reversed(isas):
                use(isa)
                t0 = time.perf_counter()
                out = model(ids[ctx : ctx + t], ctx, positions=pos, mask=mask if t > 1 else None).logits
                dt = time.perf_counter() - t0
                if r >= 2:
                    times[isa][t].append(dt)
                if first is None:
                    first = out.clone()
                same[isa][t] = bool(torch.equal(out, first))
ms = {isa: {t: round(1000 * statistics.median(v), 2) for t, v in d.items()} for isa, d in times.items()}
# per repeat, build B's time over build A's (same minute), then the median: the drift-free ratio
ratios = {
    isa: {
        t: round(statistics.median(b / a for a, b in zip(times[isas[0]][t], times[isa][t], strict=True)), 3)
        for t in rows
    }
    for isa in isas[1:]
}
result = {
    "command": "python results/bench/step-cost/isa_ab.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
    "machine": machine_facts(args.threads),
    "context_tokens": ctx,
    "builds": isas,
    "ms": ms,
    f"x_{isas[0]}": ratios,
    "bitwise_same_as_first": same,
}
print(json.dumps(result, indent=1))
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
