"""Acceptance of the demo drafters on Spec-Bench, all in one interleaved run (greedy, full head, --tree).

AR runs once per prompt; every drafter decodes the same prompt right after it, and its output is
checked token for token against AR. Reports tau per category, the head time per round and the
head-time ratio of the low-rank drafter to the full-head one measured in the same run.

    python results/training/eval_drafters.py --limit 10 --max-new-tokens 128 --threads 2 \
        --drafters eagle2=spechead/drafters/eagle2 eagle3=spechead/drafters/eagle3 \
                   lowrank72=spechead/drafters/eagle3-lowrank72 --out results/training/eval.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from spechead.bench.suites import MT_BENCH, load_suite
from spechead.cli.bench import default_eval_dir
from spechead.decoding.session import Session
from spechead.decoding.tree import TreeConfig
from spechead.model.drafter import load_drafter


def six_categories(rows: list[dict], limit: int) -> list[dict]:
    """Spec-Bench's six groups, ``limit`` prompts each (MT-bench's 8 sub-categories taken round-robin)."""
    groups: dict[str, list[dict]] = {}
    mt: dict[str, list[dict]] = {}
    for r in rows:
        if r["category"] in MT_BENCH:
            mt.setdefault(r["category"], []).append(r)
        else:
            groups.setdefault(r["category"], []).append(r)
    rr = [x for tier in zip(*mt.values(), strict=False) for x in tier]
    per = [[dict(r, category="mt_bench", sub=r["category"]) for r in rr[:limit]]] + [g[:limit] for g in groups.values()]
    return [x for tier in zip(*per, strict=False) for x in tier]  # round-robin: a cut-short run covers every group


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafters", nargs="+", required=True, help="NAME=FOLDER ...")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--categories", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tree", default="2x4x8", help="draft tree; the default has no lookup branch (the drafter alone)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    session = Session.open("demo", max_len=2048)
    prompts = six_categories(load_suite("spec-bench", eval_dir=default_eval_dir()), args.limit)
    if args.categories:
        prompts = [p for p in prompts if p["category"] in args.categories.split(",")]
    ar = session.decoder()
    decs = {}
    for spec in args.drafters:
        name, _, folder = spec.partition("=")
        decs[name] = session.decoder(load_drafter(folder, session.target), "full", TreeConfig.parse(args.tree))
    rows = []
    t0 = time.time()
    for i, p in enumerate(prompts):
        ids = session.encode([{"role": "user", "content": p["turns"][0]}])
        ref = ar.generate(ids, args.max_new_tokens, speculative=False)
        row = {"id": p["id"], "category": p["category"], "ar_tokens": len(ref.tokens), "ar_s": ref.wall_s}
        for name, dec in decs.items():
            r = dec.generate(ids, args.max_new_tokens)
            row[name] = {
                "tau": r.tau,
                "rounds": len(r.accept_lengths),
                "identical": r.tokens == ref.tokens,
                "wall_s": r.wall_s,
                "head_ms": r.timers_ms.get("head", 0.0),
            }
        rows.append(row)
        taus = " ".join(f"{n}={row[n]['tau']:.2f}" for n in decs)
        print(f"[{i + 1}/{len(prompts)} {time.time() - t0:.0f}s] {p['category']}: {taus}", flush=True)
        out = report(rows, list(decs), args)  # rewritten after every prompt, so a cut-short run still counts
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["summary"], indent=2))


def report(rows: list[dict], names: list[str], args) -> dict:
    summary = {}
    for name in names:
        per_cat: dict[str, list[float]] = {}
        for r in rows:
            per_cat.setdefault(r["category"], []).append(r[name]["tau"])
        rounds = sum(r[name]["rounds"] for r in rows)
        summary[name] = {
            "tau_mean_of_prompts": statistics.mean(r[name]["tau"] for r in rows),
            "tau_all_rounds": sum(r[name]["tau"] * r[name]["rounds"] for r in rows) / max(1, rounds),
            "tau_per_category": {c: statistics.mean(v) for c, v in per_cat.items()},
            "mismatches_vs_ar": sum(not r[name]["identical"] for r in rows),
            "head_ms_per_round": sum(r[name]["head_ms"] for r in rows) / max(1, rounds),
            "tokens_per_s": statistics.mean(r["ar_tokens"] / r[name]["wall_s"] for r in rows),
        }
    summary["ar"] = {"tokens_per_s": statistics.mean(r["ar_tokens"] / r["ar_s"] for r in rows)}
    config = {
        "prompts": len(rows),
        "limit_per_category": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "tree": args.tree,
        "greedy": True,
    }
    return {"config": config, "summary": summary, "rows": rows}


if __name__ == "__main__":
    main()
