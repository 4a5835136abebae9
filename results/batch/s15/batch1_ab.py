"""Batch-1 decoding speed of whichever spechead is imported (run it once per source tree, interleaved; see
batch1_ab.sh): 6 Spec-Bench first turns x 64 new tokens, AR and the full head on 1x0x2+lookup:8 (the tree the
tuner picks for the server here), twice each, tokens/s and prefill seconds, 2 threads."""

import sys
import time

import torch

from spechead.bench.suites import load_suite
from spechead.cli.bench import default_eval_dir
from spechead.decoding.session import Session, resolve_drafter
from spechead.decoding.tree import TreeConfig

torch.set_num_threads(2)
s = Session.open("demo", 2048)
drafter = resolve_drafter("demo", s.target)
prompts = [s.encode(r["turns"][0]) for r in load_suite("spec-bench", limit=1, eval_dir=default_eval_dir())[:6]]
decoders = {"ar": s.decoder(), "spec": s.decoder(drafter, "full", TreeConfig(1, 0, 2, lookup=8))}
for name, d in decoders.items():
    d.generate(prompts[0], 8, speculative=name == "spec")  # warm-up
res: dict[str, list[str]] = {name: [] for name in decoders}
for _ in range(2):
    for name, d in decoders.items():
        t0, n, pre = time.perf_counter(), 0, 0.0
        for p in prompts:
            r = d.generate(p, 64, speculative=name == "spec")
            n, pre = n + len(r.tokens), pre + r.prefill_s
        res[name].append(f"{n / (time.perf_counter() - t0):.1f} tok/s (prefill {pre:.2f} s)")
print(sys.argv[1] if len(sys.argv) > 1 else "", res)
