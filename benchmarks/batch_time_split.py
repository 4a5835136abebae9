"""Where the batched decoder's time goes: prefill against verification rounds, per batch size and method.

``Decoder`` on the prompts ``batch_vs_vllm.py`` and ``vllm_bench.py`` use (8 Spec-Bench first turns of at most
400 tokens, 64 new tokens each, 2 threads): one warm-up generate per batch size and method, then the decoder's own
timers over one timed generate. For a head, the rounds each mode ran (speculative / AR, summed over requests) too.
Prints one line per batch size and method.

    .venv/bin/python benchmarks/batch_time_split.py 1,8              # AR
    .venv/bin/python benchmarks/batch_time_split.py 8 full,nanospec  # heads on the demo drafter, tree rule, guard
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from spechead.decoding.session import Session, resolve_drafter
from spechead.tuning.measure import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench import prompts  # noqa: E402  (beside this script: the prompt set of the vLLM comparisons)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("batches", nargs="?", default="1,8", help="batch sizes, comma-separated (default 1,8)")
    p.add_argument("methods", nargs="?", default="ar", help="ar and/or heads on the demo drafter (default ar)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    session = Session.open("demo", max_len=2048)
    ids = prompts(session, 8, 400)
    print(f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}); prompt tokens {[len(p) for p in ids]}")
    methods = args.methods.split(",")
    drafter = resolve_drafter("demo", session.target) if methods != ["ar"] else None
    for b in [int(x) for x in args.batches.split(",")]:
        for m in methods:
            dec = session.decoder(max_batch=b) if m == "ar" else session.decoder(drafter, m, "auto", max_batch=b)
            dec.generate_batch(ids[:b], 8)
            dec.timers.reset()
            t0 = time.perf_counter()
            res = dec.generate_batch(ids, 64)
            wall = time.perf_counter() - t0
            new = sum(len(r.tokens) for r in res)
            parts = ", ".join(f"{k} {v / 1e3:.2f} s / {dec.timers.calls[k]} calls" for k, v in dec.timers.ms.items())
            modes = {k: sum(r.mode_rounds.get(k, 0) for r in res) for k in ("speculative", "ar")} if m != "ar" else ""
            print(f"batch {b} {m}: {new / wall:.1f} tok/s, wall {wall:.2f} s: {parts} {modes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
