"""Should the context-lookup branch match single tokens? ``ContextLookup`` matches the context's last 3 or 2 tokens
(``max_ngram``, ``min_ngram``); with 1 it proposes a branch far more often. Tau goes up; does speed?

NanoSpec on a 1x0x2+lookup:8 tree over the benchmark's 14 first turns (Spec-Bench + HumanEval, one per category),
96 new tokens, no guard, interleaved per prompt with AR, one warm-up pass then one timed pass; greedy, so the
outputs are AR's whatever the branch proposes.

    .venv/bin/python results/bench/lookup/min_ngram.py > results/bench/lookup/min_ngram_s22_zen4.txt
"""

import os
import time
from pathlib import Path

import torch

import spechead.decoding.decoder as decoder_module
from spechead.bench.suites import load_suite, round_robin
from spechead.decoding.session import Session, resolve_drafter
from spechead.decoding.tree import ContextLookup
from spechead.tuning.measure import machine_facts

TREE = "1x0x2+lookup:8"
NGRAMS = [(3, 2), (3, 1)]  # (max_ngram, min_ngram); (3, 2) is the default


def main() -> None:
    torch.set_num_threads(2)
    session = Session.open("demo", max_len=2048)
    drafter = resolve_drafter("demo", session.target)
    eval_dir = Path(os.environ.get("SPECHEAD_EVAL_DIR", Path(__file__).resolve().parents[4] / "shared/data/eval"))
    rows = round_robin(load_suite("spec-bench,humaneval", limit=1, limit_mt=1, eval_dir=eval_dir))
    prompts = [session.encode(r["turns"][0]) for r in rows]
    ar = session.decoder(None)
    decoders = {ng: session.decoder(drafter, "nanospec", TREE, guard=None) for ng in NGRAMS}
    totals = {k: [0.0, 0, []] for k in ["ar", *NGRAMS]}
    for timed in (False, True):
        for ids in prompts:
            for key in ["ar", *NGRAMS]:
                if key != "ar":  # the decoder builds its lookup per request from this name
                    decoder_module.ContextLookup = lambda ng=key: ContextLookup(*ng)
                dec = ar if key == "ar" else decoders[key]
                t0 = time.perf_counter()
                res = dec.generate(ids, 96, speculative=key != "ar")
                if timed:
                    totals[key][0] += time.perf_counter() - t0
                    totals[key][1] += len(res.tokens)
                    totals[key][2] += res.accept_lengths
    decoder_module.ContextLookup = ContextLookup
    print(machine_facts(2))
    ar_rate = totals["ar"][1] / totals["ar"][0]
    for key, (wall, n, accepted) in totals.items():
        tau = sum(accepted) / len(accepted) if accepted else 1.0
        name = "ar" if key == "ar" else f"nanospec@{TREE} max_ngram {key[0]} min_ngram {key[1]}"
        print(f"{name}: {n / wall:.2f} tok/s, {n / wall / ar_rate:.3f}x ar, tau {tau:.3f}")


if __name__ == "__main__":
    main()
