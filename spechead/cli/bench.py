"""``spechead bench``: the command line of the end-to-end benchmark (:mod:`spechead.bench.harness`).

Where the data lives is decided here, not in the library: named suites are read from ``--eval-dir``
(default: ``$SPECHEAD_EVAL_DIR``, else ``shared/data/eval`` next to the checkout), and the 8B projection runs
when ``--heads-json`` names a ``spechead bench-heads`` result.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from spechead.bench.harness import run_bench, write_outputs
from spechead.bench.llamacpp import unavailable
from spechead.bench.methods import PRESETS, check_methods, expand_methods
from spechead.bench.runners import LOWRANK_DEMO
from spechead.bench.suites import EVAL_DIR_ENV, SUITES, load_suite, round_robin
from spechead.cli.args import (
    AUTO_TREE_HELP,
    add_compile,
    add_max_len,
    add_sampling,
    add_target,
    add_threads,
    non_negative_int,
    positive_int,
)
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.session import AUTO_TREE
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.tuning.tune import open_session

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout (its sibling shared/ holds the data)


def default_eval_dir() -> Path:
    """``$SPECHEAD_EVAL_DIR``, else the checkout's sibling ``shared/data/eval``, else ``../shared/data/eval``
    from the current folder: the first that holds a named suite (the first, for the error message, if none)."""
    env = os.environ.get(EVAL_DIR_ENV)
    candidates = ([Path(env)] if env else []) + [
        REPO_ROOT.parent / "shared" / "data" / "eval",
        Path.cwd().parent / "shared" / "data" / "eval",
    ]
    return next((c for c in candidates if any((c / f).is_file() for f in SUITES.values())), candidates[0])


def add_eval_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--eval-dir",
        default=None,
        help=f"folder holding {' and '.join(SUITES.values())} (default: ${EVAL_DIR_ENV}, else shared/data/eval "
        "next to the checkout)",
    )


def eval_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.eval_dir) if args.eval_dir else default_eval_dir()


def format_table(out: dict[str, Any]) -> str:
    """The table ``spechead bench`` prints: one row per method, then the speedup model and the projection."""
    cfg = out["config"]
    lines = [
        f"{cfg['prompts']} prompts, {cfg.get('max_new_tokens')} new tokens, {cfg['threads']} threads, "
        f"tree {cfg['tree']}" + (" (INTERRUPTED: partial results)" if cfg.get("interrupted") else ""),
        f"{'method':<26}{'tok/s':>8}{'dec/s':>8}{'tau':>7}{'vs ar':>8}{'vs hf':>8}{'mismatch':>10}"
        f"{'bb ms':>8}{'head ms':>9}{'gath ms':>9}{'verify':>8}",
    ]
    nan = float("nan")
    for name, m in out["methods"].items():
        r = m.get("round_ms", {})
        label = f"{name}@{m['tree_auto']['tree']}" if "tree_auto" in m else name  # the tree --tree auto chose
        lines.append(
            f"{label:<26}{m['tokens_per_s']:>8.2f}{m.get('decode_tokens_per_s', nan):>8.2f}{m['tau']:>7.2f}"
            f"{m.get('speedup_vs_ar', nan):>8.2f}{m.get('speedup_vs_hf', nan):>8.2f}"
            f"{m.get('mismatches_vs_ar', '-'):>10}"
            f"{r.get('backbone', nan):>8.2f}{r.get('head', nan):>9.2f}{r.get('gather', nan):>9.2f}"
            f"{r.get('verify', nan):>8.2f}"
        )
    for name, m in out["methods"].items():
        if "same_output_as_ar" in m:
            lines.append(
                f"{name}: output equal to ar's on {m['same_output_as_ar']:.0%} of prompts (llama.cpp computes on the "
                "quantized weights, so its outputs are not held to ar's)"
            )
    sm = out.get("speedup_model", {})
    if sm.get("methods"):
        kap = ", ".join(f"{k} {v:.3f}" for k, v in sm["kappa"].items())
        lines.append(f"\nspeedup model (kappa: {kap}): predicted rho_tau (1+kappa)/(1+nu kappa) vs measured (decode)")
        lines.append(f"{'method':<26}{'vs':>8}{'nu':>8}{'rho_tau':>9}{'predicted':>11}{'measured':>10}{'error':>8}")
        for name, v in sm["methods"].items():
            lines.append(
                f"{name:<26}{v['reference']:>8}{v['nu']:>8.3f}{v['rho_tau']:>9.3f}{v['predicted']:>11.3f}"
                f"{v['measured']:>10.3f}{v['error']:>+8.1%}"
            )
    pj = out.get("projection_llama3.1-8b", {})
    if pj.get("methods"):
        lines.append(
            f"\nprojected at Llama-3.1-8B shapes ({pj['dtype']}, kappa {pj['kappa']:.3f}, from {pj['source']})"
        )
        for name, v in pj["methods"].items():
            lines.append(
                f"{name:<26}nu {v['nu']:.3f}  rho_tau {v['rho_tau']:.3f}  vs full head {v['speedup_vs_full_head']:.3f}"
                f"  vs ar {v['speedup_vs_ar']:.3f}"
            )
    return "\n".join(lines)


def parse_batches(text: str) -> list[int]:
    try:
        batches = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise SpecheadError(f"--batch wants comma-separated batch sizes such as 1,2,4,8, got {text!r}") from None
    if not batches or min(batches) < 1 or max(batches) > 64:
        raise SpecheadError(f"--batch sizes must be in [1, 64], got {text!r}")
    return batches


def cmd_batch_study(args: argparse.Namespace, prompts: list[dict[str, Any]], methods: list[str]) -> int:
    """``bench --batch``: the batch study (first turns of the prompts, the engine's methods)."""
    import torch

    from spechead.bench.batch import format_batch_table, plot_batch_study, run_batch_study
    from spechead.bench.harness import jsonable
    from spechead.tuning.measure import cpu_name

    batches = parse_batches(args.batch)
    repeats = args.repeats or 3  # a batch round is short: three passes unless told
    tree = None if args.tree is None or args.tree.strip() == AUTO_TREE else TreeConfig.parse(args.tree)
    specs = check_methods(methods, tree)
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    session = open_session(args.target, args.max_len, args.dtype, compile=args.compile)
    ids = [session.encode(p["turns"][0]) for p in prompts]
    drafters = {"arch": args.arch}
    drafters.update({k: v for k, v in (("eagle3", args.eagle3_drafter), ("lowrank", args.lowrank_drafter)) if v})
    out = run_batch_study(
        session,
        ids,
        specs,
        batches,
        drafters,
        args.max_new_tokens,
        sampling,
        tree,
        repeats=repeats,
        guard=not args.no_guard,
    )
    out["config"] = {
        "prompts": len(ids), "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
        "cpu": f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()})", "suite": args.suite,
        "tree": args.tree, "repeats": repeats, "guard": not args.no_guard,
        "command": "spechead " + shlex.join(sys.argv[1:]),
    }  # fmt: skip
    print(format_batch_table(out))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(jsonable(out), indent=1, allow_nan=False))
    if args.report:
        folder = Path(args.report)
        folder.mkdir(parents=True, exist_ok=True)
        plot_batch_study(out, folder / "batch_tokens_per_s.png")
        text = f"# Batch study\n\n`{out['config']['command']}`\n\n![](batch_tokens_per_s.png)\n\n```\n"
        (folder / "report.md").write_text(text + format_batch_table(out) + "\n```\n")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    cats = args.categories.split(",") if args.categories else None
    prompts = round_robin(load_suite(args.suite, args.limit, cats, args.limit_mt, eval_dir_of(args)))
    methods = expand_methods(args.methods)
    if args.batch:
        return cmd_batch_study(args, prompts, methods)
    if not methods:
        raise SpecheadError("no methods given")
    tree = AUTO_TREE if args.tree is None or args.tree.strip() == AUTO_TREE else TreeConfig.parse(args.tree)
    refused = unavailable(check_methods(methods, None if tree == AUTO_TREE else tree))
    if refused and len(refused) == len(methods):  # nothing else to run: refused before the model loads
        raise SpecheadError(next(iter(refused.values())))
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    session = open_session(args.target, args.max_len, args.dtype, compile=args.compile)
    drafters = {"arch": args.arch}  # --eagle3-drafter / --lowrank-drafter default to --drafter
    drafters.update({k: v for k, v in (("eagle3", args.eagle3_drafter), ("lowrank", args.lowrank_drafter)) if v})
    heads_json = Path(args.heads_json) if args.heads_json else None
    out = run_bench(
        session, prompts, methods, args.drafter, args.max_new_tokens, sampling, tree,
        progress=not args.quiet, warmup=args.warmup, drafters=drafters, heads_json=heads_json,
        guard=not args.no_guard, repeats=args.repeats or 1,
    )  # fmt: skip
    out["config"]["guard"] = not args.no_guard
    out["config"]["command"] = "spechead " + shlex.join(sys.argv[1:])
    out["config"]["suite"] = args.suite
    if args.note:
        out["config"]["note"] = args.note
    print(format_table(out))
    write_outputs(out, args.json, args.report)
    return 130 if out["config"]["interrupted"] else 0


def add_cli(sub) -> None:
    """The ``bench`` subcommand."""
    b = sub.add_parser("bench", help="benchmark methods side by side on a prompt suite")
    b.add_argument(
        "--suite",
        default="spec-bench",
        help="spec-bench, humaneval, a JSONL file with 'turns', or a,b; NAME:N caps that suite at N per category",
    )
    b.add_argument("--limit", type=positive_int, default=None, help="prompts per category")
    b.add_argument(
        "--limit-mt", type=positive_int, default=None, help="prompts per MT-bench category (default: --limit)"
    )
    b.add_argument("--categories", default=None, help="comma-separated categories (MT = the 8 MT-bench ones)")
    b.add_argument(
        "--methods",
        default="hf,ar,eagle",
        help="comma-separated: hf, hf-pld[:N], llamacpp, llamacpp-lookup[:N] (llama.cpp on the target's GGUF, needs "
        "llama-cpp-python), ar, eagle, eagle3, lowrank, fr:N, vocabtrim:N, nanospec[:W[:k=v]], hybrid, any head spec, "
        "[@tree]; presets: " + "; ".join(f"{k} = {v}" for k, v in PRESETS.items()),
    )
    b.add_argument("--json", default=None, help="write results to this file")
    b.add_argument("--report", default=None, help="write a Markdown report with PNG plots into this folder")
    add_eval_dir(b)
    add_target(b)
    b.add_argument("--drafter", default="demo", help="EAGLE-2 drafter: demo, random or a folder")
    b.add_argument("--eagle3-drafter", default=None, help="drafter for 'eagle3' (default: --drafter)")
    b.add_argument(
        "--lowrank-drafter", default=None, help=f"drafter for 'lowrank' (default: --drafter; demo: {LOWRANK_DEMO})"
    )
    b.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"], help="kind of --drafter (for demo/random)")
    b.add_argument("--tree", default=AUTO_TREE, help=AUTO_TREE_HELP + "; auto is resolved per (drafter, head)")
    b.add_argument(
        "--heads-json",
        default=None,
        help="a `spechead bench-heads` JSON with the llama3.1-8b shape: project the speedups to Llama-3.1-8B",
    )
    b.add_argument("--max-new-tokens", type=int, default=64)
    add_max_len(b)
    add_sampling(b)
    add_threads(b)
    add_compile(b)
    b.add_argument("--warmup", type=non_negative_int, default=1, help="prompts run (turn 1, 16 tokens) before timing")
    b.add_argument(
        "--no-guard", action="store_true", help="speculate every round (no fallback to AR when slower): raw speed"
    )
    b.add_argument(
        "--batch",
        default=None,
        help="the batch study: comma-separated batch sizes (e.g. 1,2,4,8,16); every method on the batched decoder, "
        "first turns only, tree per batch size by spechead.bench.batch.batch_tree unless --tree/@TREE is given",
    )
    b.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed passes of every prompt (or batch) per method, the methods interleaved; each figure is the "
        "median pass (default 1, with --batch 3)",
    )
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--note", default=None, help="a line shown at the top of the report (e.g. 'smoke run')")
    b.set_defaults(func=cmd_bench)
