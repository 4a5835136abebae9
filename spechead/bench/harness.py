"""End-to-end benchmark (``spechead bench``): methods side by side on the same prompts, interleaved, warm-up first.

Per method: tokens/s (mean over prompts of new tokens / wall time, Spec-Bench style, prefill
included; and decode-only, prefill excluded), tau (mean tokens committed per target forward),
speedups against ``ar`` and ``hf``, the per-round milliseconds of drafter backbone / head / gather /
verification, head telemetry (NanoSpec's active size and coverage), ``mismatches_vs_ar`` (prompts whose
tokens differ from the engine's own AR output: greedy, or sampled with ``--seed``) and the memory each head holds.
Multi-turn prompts (MT-bench) run every turn: each method's own answer goes back into the
conversation, as in Spec-Bench. ``hf`` is transformers' ``generate`` on the same weights and thread
count, ``hf-pld`` its prompt-lookup decoding; ``llamacpp`` and ``llamacpp-lookup`` llama.cpp on the target's GGUF
(:mod:`spechead.bench.llamacpp`), whose agreement with AR is reported as ``same_output_as_ar``, not as mismatches.

This module runs the pieces in order: methods (:mod:`spechead.bench.methods`), runners
(:mod:`spechead.bench.runners`), the interleaved loop, the statistics (:mod:`spechead.bench.analysis`),
the 8B projection (:mod:`spechead.bench.projection`) and the JSON / report files.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spechead.bench.analysis import add_speedup_model, evolution, summarize, tau_of
from spechead.bench.llamacpp import same_output_share
from spechead.bench.methods import MethodSpec, check_methods
from spechead.bench.projection import project
from spechead.bench.report import write_report
from spechead.bench.runners import Runner, build_runners, run_prompt
from spechead.bench.runs import Run
from spechead.bench.suites import group_of
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.session import AUTO_TREE, Session
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(
    session: Session,
    prompts: list[dict[str, Any]],
    methods: list[str],
    drafter_spec: str = "demo",
    max_new_tokens: int = 64,
    sampling: SamplingConfig | None = None,
    tree: TreeConfig | str | None = None,
    progress: bool = True,
    warmup: int = 1,
    drafters: dict[str, str] | None = None,
    heads_json: Path | None = None,
    guard: bool = True,
    repeats: int = 1,
) -> dict[str, Any]:
    """``repeats``: timed passes of every prompt per method (``bench_loop``). ``guard``: speculative methods run
    with the engine's never-slower-than-AR guard, as users get them (their AR steps are left out of the per-round
    times the speedup model uses). ``tree``: a TreeConfig or spec for every method without its own ``@tree``, None
    for DEFAULT_TREE, or ``auto``: each (drafter, head)'s tuning, resolved once (``config.trees`` and each method's
    ``tree_spec`` say which tree it ran). ``heads_json``: a ``spechead bench-heads`` JSON for the 8B projection
    (none without it)."""
    from spechead.decoding.session import DEFAULT_TREE

    sampling = sampling or SamplingConfig()
    auto = isinstance(tree, str) and tree.strip() == AUTO_TREE
    if isinstance(tree, str) and not auto:
        tree = TreeConfig.parse(tree)
    tree = None if auto else tree or DEFAULT_TREE
    specs = check_methods(methods, tree)
    drafters = {"eagle2": drafter_spec, "eagle3": drafter_spec, "lowrank": drafter_spec, **(drafters or {})}
    log = (lambda msg: tqdm.write(msg, file=sys.stderr)) if progress else (lambda msg: None)
    runners, info, skipped = build_runners(session, specs, drafters, log, guard)
    specs = [s for s in specs if s.name in runners]
    if not specs:
        raise SpecheadError("no method could be built: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    results = bench_loop(
        runners, prompts, session.encode, session.decode, max_new_tokens, sampling, progress, warmup, repeats
    )
    spec_trees = [s.tree for s in specs if s.kind == "spec"]
    full_tree = next((s.tree for s in specs if s.kind == "spec" and s.head == "full"), None)
    # under auto, the report's round (the 8B projection) is the full head's tuned tree, else the first method's
    report_tree = tree or full_tree or next(iter(spec_trees), DEFAULT_TREE)
    out = make_report_data(results, prompts, specs, sampling, report_tree, heads_json)
    if auto:
        out["config"]["tree"] = AUTO_TREE
        out["config"]["trees"] = {s.name: str(s.tree) for s in specs if s.kind == "spec"}
    out["config"].update(
        {
            "target": str(session.folder),
            "drafter": drafter_spec,
            "drafters": _by_drafter(specs, info),
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "skipped": skipped,
        }
    )
    for s in specs:
        out["methods"][s.name].update({k: v for k, v in info[s.name].items() if k != "kind"})
    return out


def _by_drafter(specs: list[MethodSpec], info: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """{drafter: [methods using it]}."""
    out: dict[str, list[str]] = {}
    for s in specs:
        if "drafter" in info[s.name]:
            out.setdefault(info[s.name]["drafter"], []).append(s.name)
    return out


def bench_loop(
    runners: dict[str, Runner],
    prompts: list[dict[str, Any]],
    encode,
    decode,
    max_new_tokens: int,
    sampling: SamplingConfig,
    progress: bool = True,
    warmup: int = 1,
    repeats: int = 1,
) -> dict[str, Any]:
    """Warm-up, then for every prompt every method in turn (interleaved, so machine drift hits all
    alike), ``repeats`` passes of that; a method's run of a prompt is its median pass by wall time (one
    prompt's turn takes about a second, and a shared host's speed moves by more than the gap between two
    methods from one second to the next). A Ctrl-C keeps what finished: the prompts every method completed."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    results: dict[str, list[Run]] = {name: [] for name in runners}
    interrupted, t0 = False, time.perf_counter()
    try:
        for p in prompts[:warmup]:
            for run in runners.values():
                one = {**p, "turns": p["turns"][:1]}
                run_prompt(run, one, encode, decode, min(16, max_new_tokens), sampling)
        bar = tqdm(prompts, desc="bench", disable=not progress, unit="prompt", file=sys.stderr)
        for p in bar:
            passes: dict[str, list[Run]] = {name: [] for name in runners}
            for _ in range(repeats):
                for name, run in runners.items():
                    bar.set_postfix_str(f"{p['category']} {name}")
                    passes[name].append(run_prompt(run, p, encode, decode, max_new_tokens, sampling))
            for name, runs in passes.items():
                results[name].append(sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2])
    except KeyboardInterrupt:
        interrupted = True
    n = min(len(v) for v in results.values())
    return {
        "runs": {k: v[:n] for k, v in results.items()},
        "interrupted": interrupted,
        "elapsed_s": time.perf_counter() - t0,
    }


def make_report_data(
    results: dict[str, Any],
    prompts: list[dict[str, Any]],
    specs: list[MethodSpec],
    sampling: SamplingConfig,
    tree: TreeConfig,
    heads_json: Path | None = None,
) -> dict[str, Any]:
    """The JSON document: config, per-method summaries (overall, per category, per group), the
    speedup model, the projection (when ``heads_json`` names an existing file), and per-prompt figures."""
    runs: dict[str, list[Run]] = results["runs"]
    n = min((len(v) for v in runs.values()), default=0)
    done = prompts[:n]
    ar_name = next((s.name for s in specs if s.kind == "ar"), None)
    hf_name = next((s.name for s in specs if s.kind == "hf"), None)
    ar_runs = runs[ar_name] if ar_name else None
    summary: dict[str, Any] = {}
    for s in specs:
        rs = runs[s.name]
        # the engine's seeded sampling is AR's text too (draws per position); transformers' sampler is another one;
        # llama.cpp computes on the quantized weights: its agreement with AR is a share, never a mismatch
        exact = sampling.greedy or (sampling.seed is not None and s.kind not in ("hf", "pld"))
        exact = exact and s.kind != "llamacpp"
        m = summarize(rs, ar_runs, exact)
        m["method"] = s.kind if s.kind != "spec" else s.head
        if s.kind == "llamacpp" and ar_runs is not None:
            m["same_output_as_ar"] = same_output_share(rs, ar_runs)
        if s.kind == "pld":  # generate() does not report its verification rounds
            m["tau"] = m["tau_median"] = float("nan")
        cats: dict[str, list[int]] = {}
        for i, p in enumerate(done):
            cats.setdefault(p["category"], []).append(i)
            if group_of(p["category"]):
                cats.setdefault(group_of(p["category"]), []).append(i)
        m["per_category"] = {}
        for c, idx in cats.items():
            cm = summarize([rs[i] for i in idx], [ar_runs[i] for i in idx] if ar_runs else None, exact)
            keep = ("prompts", "tokens_per_s", "tokens_per_s_median", "decode_tokens_per_s", "tau", "round_ms")
            m["per_category"][c] = {k: v for k, v in cm.items() if k in keep or k in ("head_stats",)}
            if any(rs[i].trace for i in idx):
                m["per_category"][c]["evolution"] = evolution([rs[i] for i in idx])
        m["per_prompt"] = [
            {"tokens_per_s": r.tokens_per_s, "tau": tau_of(r), "new_tokens": len(r.tokens), "wall_s": r.wall_s}
            for r in rs
        ]
        if s.kind == "llamacpp" or (s.kind == "ar" and any(x.kind == "llamacpp" for x in specs)):
            for row, r in zip(m["per_prompt"], rs, strict=True):  # the outputs, to compare llama.cpp's with AR's
                row["prefill_ms"], row["tokens"] = r.prefill_s * 1e3, r.tokens
        summary[s.name] = m
    for key, base in (("speedup_vs_ar", ar_name), ("speedup_vs_hf", hf_name)):
        if base and summary[base]["tokens_per_s"] > 0:
            for s in specs:
                summary[s.name][key] = summary[s.name]["tokens_per_s"] / summary[base]["tokens_per_s"]
                for c, cm in summary[s.name]["per_category"].items():
                    cm[key] = cm["tokens_per_s"] / summary[base]["per_category"][c]["tokens_per_s"]
    out: dict[str, Any] = {
        "config": {
            "temperature": sampling.temperature,
            "seed": sampling.seed,
            "threads": torch.get_num_threads(),
            "tree": vars(tree),
            "prompts": n,
            "interrupted": results["interrupted"],
            "elapsed_s": results.get("elapsed_s"),
            "peak_rss_mb": peak_rss_mb(),
            "torch": torch.__version__,
            "cpu": _cpu_name(),
        },
        "methods": summary,
        "prompts": [{"id": p["id"], "category": p["category"], "turns": len(p["turns"])} for p in done],
    }
    out["speedup_model"] = add_speedup_model(summary, specs) if n else {"kappa": {}, "methods": {}}
    if n and heads_json is not None and heads_json.is_file():
        try:
            out["projection_llama3.1-8b"] = project(summary, specs, tree, heads_json)
        except (KeyError, ValueError, SpecheadError) as e:
            out["projection_llama3.1-8b"] = {"error": str(e)}
    return out


def _cpu_name() -> str:
    from spechead.tuning.measure import cpu_name

    return cpu_name()


def jsonable(x: Any) -> Any:
    """Strict JSON: NaN and infinities (a figure that does not apply) become null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def write_outputs(out: dict[str, Any], json_path: str | None, report_dir: str | None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(jsonable(out), indent=1, allow_nan=False))
        print(f"wrote {json_path}", file=sys.stderr)
    if report_dir:
        path = write_report(out, Path(report_dir))
        print(f"wrote {path}", file=sys.stderr)
