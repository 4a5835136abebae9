"""The demo target's decode step against its bytes floor, and a verification of 1-16 rows against the step,
on the kernel build this process uses (run it once per build with SPECHEAD_ISA=avx512|avx2|generic).

The floor: a decode step reads every weight once (537 MB in fp32 for SmolLM2-135M, 112 MB of packed blocks at
gguf: ``--dtype``) and every visible key and value of every layer once (fp32: 27.6 MB at 600 tokens for
SmolLM2-135M), so it cannot beat bytes / read bandwidth, the bandwidth measured here as the median of a sum over
256 MB (the same measurement the benchmark's step figures use). Steps run at 600 tokens of context, under a tree
mask for verification as in the engine; medians of --repeats after two warm-ups, the bandwidth sampled between steps.
Prints the JSON it writes: ``ms`` per row count, ``step_x_floor`` and ``x_decode_step``.

    SPECHEAD_ISA=avx512 .venv/bin/python benchmarks/step_cost.py --threads 2 --out runs/step_avx512.json
"""

import argparse
import json
import os
import statistics
import time

import torch

from spechead import kernels
from spechead.decoding.session import Session
from spechead.tuning.measure import machine_facts

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,2,4,8,12,16")
p.add_argument("--context", type=int, default=600, help="tokens already in the cache")
p.add_argument("--repeats", type=int, default=15)
p.add_argument("--dtype", default="auto", help="the target's precision: auto (gguf), gguf, fp32")
p.add_argument("--out", required=True, help="JSON file to write")
args = p.parse_args()
torch.set_num_threads(args.threads)
rows = [int(r) for r in args.rows.split(",")]
ctx = args.context

buf = torch.ones(256 * 2**20 // 4)


def read_gbps() -> float:
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * 4 / (time.perf_counter() - t0) / 1e9


model = Session.open("demo", 2048, dtype=args.dtype).target
model.prepack()
# every tensor a step reads once: parameters and the quantized projections' blocks (a tied embedding is the LM
# head, read once per step; an untied one is only indexed)
tensors = {
    t.data_ptr(): t
    for n, t in [*model.named_parameters(), *model.named_buffers()]
    if ("embed_tokens" not in n or model.config.tie_word_embeddings) and "cache" not in n and "rotary" not in n
}
weights = sum(t.numel() * t.element_size() for t in tensors.values())
caches = [layer.self_attn.cache for layer in model.model.layers]  # the keys and values of ctx slots, lane 0
kv_bytes = sum(2 * c.k[0, :, :ctx].numel() * c.k.element_size() for c in caches)
ids = torch.randint(0, 40000, (ctx + max(rows),), generator=torch.Generator().manual_seed(0))
ms: dict[int, float] = {}
bw: list[float] = []
with torch.inference_mode():
    model(ids[:ctx], 0, logits_rows=None)
    for t in rows:
        mask = torch.ones(t, ctx + t, dtype=torch.bool)
        mask[:, ctx:] = torch.ones(t, t, dtype=torch.bool).tril()  # a chain: the tree mask's densest case
        pos = torch.arange(ctx, ctx + t)
        times = []
        for r in range(args.repeats + 2):
            read_gbps()
            bw.append(read_gbps())
            t0 = time.perf_counter()
            model(ids[ctx : ctx + t], ctx, positions=pos, mask=mask if t > 1 else None)
            if r >= 2:
                times.append(time.perf_counter() - t0)
        ms[t] = round(1000 * statistics.median(times), 2)
gbps = statistics.median(bw)
floor_ms = (weights + kv_bytes) / gbps / 1e6
result = {
    "command": "python benchmarks/step_cost.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
    "machine": machine_facts(args.threads),
    "kernels": kernels.active_isa() or f"none: {kernels.unavailable_reason()}",
    "SPECHEAD_ISA": os.environ.get("SPECHEAD_ISA", ""),
    "dtype": model.precision,
    "context_tokens": ctx,
    "weights_MB": round(weights / 1e6, 1),
    "kv_MB": round(kv_bytes / 1e6, 1),
    "read_GBps": round(gbps, 2),
    "floor_ms": round(floor_ms, 2),
    "ms": ms,
    "step_x_floor": round(ms[rows[0]] / floor_ms, 3),
    "x_decode_step": {t: round(v / ms[rows[0]], 3) for t, v in ms.items()},
}
print(json.dumps(result, indent=1))
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
