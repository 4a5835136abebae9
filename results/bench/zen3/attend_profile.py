"""Where the demo target's forward spends its time at 1 / 8 / 16 rows over 600 cached slots, op by op: the
modules path (one kernel op per projection, attention, SiLU x up, norm) under torch.profiler, cold caches as in
decoding. The per-layer `attend` figures in docs/heads.md ("The rest of a decode step") come from it.

    .venv/bin/python results/bench/zen3/attend_profile.py --threads 2 --rows 1,8,16
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from spechead import kernels
from spechead.decoding.session import Session
from spechead.tuning.measure import cpu_name

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,8,16")
p.add_argument("--repeats", type=int, default=5)
args = p.parse_args()
torch.set_num_threads(args.threads)
rows = [int(r) for r in args.rows.split(",")]
model = Session.open("demo", 2048).target
model.prepack(max(rows))
ctx = 600
ids = torch.randint(0, 40000, (ctx + max(rows),), generator=torch.Generator().manual_seed(0))
layers = model.config.num_hidden_layers
print(f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, build {kernels.active_isa()}, {args.threads} threads")
with torch.inference_mode():
    model(ids[:ctx], 0, logits_rows=None)
    model._fused = []  # the modules, one op each, so the profiler sees each part (llama_layer runs the same ones)
    for t in rows:
        mask = torch.ones(t, ctx + t, dtype=torch.bool)
        mask[:, ctx:] = torch.ones(t, t, dtype=torch.bool).tril()
        pos = torch.arange(ctx, ctx + t)

        def forward(t=t, mask=mask, pos=pos):
            return model(ids[ctx : ctx + t], ctx, positions=pos, mask=mask if t > 1 else None)

        for _ in range(3):
            forward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.repeats):
                forward()
        ms = {e.key.split("::")[-1]: e.self_cpu_time_total / 1e3 / args.repeats for e in prof.key_averages()}
        parts = ("draft_linear", "attend", "silu_mul", "rms_norm")
        line = ", ".join(f"{k} {ms.get(k, 0.0):.1f} ms" for k in parts)
        print(f"{t:2d} rows, per forward: {line}; attend {1e3 * ms.get('attend', 0.0) / layers:.0f} us a layer")
