"""The demo target's prefill speed by prompt length: is the part of a load that batching cannot share near the
CPU's compute floor? Projections only (212 MFLOP a token; attention and the one row of LM head left out), median of
three after one warm-up, random token ids, 2 threads.

    .venv/bin/python results/batch/prefill_speed.py

Fourteenth session, AMD EPYC Zen 3 (AVX2, avx2 build), idle: 64 / 128 / 256 / 512 / 1024 tokens in 146 / 242 /
457 / 932 / 2041 ms = 93 / 112 / 119 / 116 / 106 GFLOP/s, against an FMA peak of about 155 GFLOP/s for both cores
(results/bench/fma_peak.c, AVX2 build: 77-79 a core with both busy). A rerun of this script the same session: 87 / 104 /
111 / 115 / 100 GFLOP/s.
"""

import statistics
import time

import torch

from spechead.decoding.session import Session
from spechead.model.transformer import BatchPart
from spechead.tuning.measure import cpu_name

FLOP_PER_TOKEN = 212e6  # 2 x the projections' 106 M weights (SmolLM2-135M without its embedding table)

torch.set_num_threads(2)
target = Session.open("demo", max_len=2048).target  # its cache: one lane of 2,048 slots
gen = torch.Generator().manual_seed(0)
print(f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), 2 threads")
for n in [64, 128, 256, 512, 1024]:
    ids = torch.randint(100, 40000, (n,), generator=gen)
    times = []
    with torch.inference_mode():
        for _ in range(4):
            t0 = time.perf_counter()
            target.forward_batch([BatchPart(ids, 0, 0, logits_rows=slice(-1, None))])
            times.append(time.perf_counter() - t0)
    s = statistics.median(times[1:])
    print(f"{n:5d} tokens: {s * 1e3:6.0f} ms, {n / s:4.0f} tok/s, {n * FLOP_PER_TOKEN / s / 1e9:4.0f} GFLOP/s")
