"""Where the batched decoder's time goes on the vLLM comparison's prompts: prefill against verification rounds.

    .venv/bin/python results/batch/time_split.py 1,8              # AR
    .venv/bin/python results/batch/time_split.py 8 full,nanospec  # heads on the demo drafter, the tree rule, the guard

``BatchDecoder`` (8 Spec-Bench first turns of at most 400 tokens, 64 new tokens each, 2 threads), one warm-up
generate per batch size and method, then the decoder's own timers over one timed generate; for a head, the rounds
each mode ran (speculative / AR, summed over requests) too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from spechead.decoding.session import Session, resolve_drafter
from spechead.tuning.measure import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
from bench import prompts  # noqa: E402  (results/vllm/bench.py: the prompts vllm_compare.py uses)


def main() -> int:
    torch.set_num_threads(2)
    session = Session.open("demo", max_len=2048)
    ids = prompts(session, 8, 400)
    print(f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()}); prompt tokens {[len(p) for p in ids]}")
    methods = (sys.argv[2] if len(sys.argv) > 2 else "ar").split(",")
    drafter = resolve_drafter("demo", session.target) if methods != ["ar"] else None
    for b in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1,8").split(",")]:
        for m in methods:
            dec = session.batch_decoder(max_batch=b) if m == "ar" else session.batch_decoder(drafter, m, "auto", b)
            dec.generate(ids[:b], 8)
            dec.timers.reset()
            t0 = time.perf_counter()
            res = dec.generate(ids, 64)
            wall = time.perf_counter() - t0
            new = sum(len(r.tokens) for r in res)
            parts = ", ".join(f"{k} {v / 1e3:.2f} s / {dec.timers.calls[k]} calls" for k, v in dec.timers.ms.items())
            modes = {k: sum(r.mode_rounds.get(k, 0) for r in res) for k in ("speculative", "ar")} if m != "ar" else ""
            print(f"batch {b} {m}: {new / wall:.1f} tok/s, wall {wall:.2f} s: {parts} {modes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
