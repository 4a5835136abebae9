"""Where the batched decoder's time goes on the vLLM comparison's prompts: prefill against verification rounds.

    .venv/bin/python results/batch/time_split.py 1,8

AR on ``BatchDecoder`` (8 Spec-Bench first turns of at most 400 tokens, 64 new tokens each, 2 threads), one warm-up
generate per batch size, then the decoder's own timers over one timed generate.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from spechead.decoding.session import Session
from spechead.tuning.measure import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
from bench import prompts  # noqa: E402  (results/vllm/bench.py: the prompts vllm_compare.py uses)


def main() -> int:
    torch.set_num_threads(2)
    session = Session.open("demo", max_len=2048)
    ids = prompts(session, 8, 400)
    print(f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}); prompt tokens {[len(p) for p in ids]}")
    for b in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,8").split(",")]:
        dec = session.batch_decoder(max_batch=b)
        dec.generate(ids[:b], 8)
        dec.timers.reset()
        t0 = time.perf_counter()
        res = dec.generate(ids, 64)
        wall = time.perf_counter() - t0
        new = sum(len(r.tokens) for r in res)
        parts = ", ".join(f"{k} {v / 1e3:.2f} s / {dec.timers.calls[k]} calls" for k, v in dec.timers.ms.items())
        print(f"batch {b}: {new / wall:.1f} tok/s, wall {wall:.2f} s: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
