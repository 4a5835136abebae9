"""End-to-end benchmark: methods side by side on the same prompts, interleaved, warm-up first.

Per method: tokens/s (mean over prompts of new tokens / wall time, Spec-Bench style, prefill
included), tau (mean tokens committed per target forward), speedup against ``ar``, and
``mismatches_vs_ar`` (greedy prompts whose tokens differ from the engine's own AR output).
``hf`` is transformers' ``generate`` on the same weights and thread count.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .loading import SpecheadError
from .pipeline import Session, resolve_drafter
from .sampling import SamplingConfig
from .tree import TreeConfig

SHARED_EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
SUITES = {"spec-bench": "spec_bench.jsonl", "humaneval": "humaneval.jsonl"}
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def suite_path(suite: str) -> Path:
    if suite in SUITES:
        for base in (SHARED_EVAL, Path.cwd().parent / "shared" / "data" / "eval"):
            if (base / SUITES[suite]).is_file():
                return base / SUITES[suite]
        raise SpecheadError(f"suite {suite} not found (expected ../shared/data/eval/{SUITES[suite]})")
    path = Path(suite)
    if not path.is_file():
        raise SpecheadError(f"suite file not found: {suite}")
    return path


def load_suite(suite: str, limit: int | None = None, categories: list[str] | None = None) -> list[dict[str, Any]]:
    """Records with ``turns`` (and ``category``); ``limit`` applies per category, in file order."""
    rows, per_cat = [], {}
    for n, line in enumerate(suite_path(suite).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            turns = rec["turns"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SpecheadError(f"{suite}:{n}: not a JSON record with 'turns': {e}") from e
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise SpecheadError(f"{suite}:{n}: 'turns' must be a non-empty list of strings")
        cat = rec.get("category", "default")
        if categories and cat not in categories and not ("MT" in categories and cat in MT_BENCH):
            continue
        if limit is not None and per_cat.get(cat, 0) >= limit:
            continue
        per_cat[cat] = per_cat.get(cat, 0) + 1
        rows.append({"id": rec.get("question_id", rec.get("id", n)), "category": cat, "turns": turns})
    if not rows:
        raise SpecheadError(f"no prompts selected from {suite}")
    return rows


@dataclass
class MethodSpec:
    name: str
    kind: str  # hf | ar | spec
    head: str = "full"
    tree: TreeConfig | None = None

    @classmethod
    def parse(cls, spec: str, default_tree: TreeConfig) -> MethodSpec:
        base, _, tree = spec.partition("@")
        t = TreeConfig.parse(tree) if tree else default_tree
        if base in ("hf", "ar"):
            return cls(spec, base)
        if base == "eagle":
            return cls(spec, "spec", "full", t)
        return cls(spec, "spec", base, t)


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    accept_lengths: list[int]
    timers_ms: dict[str, float] = field(default_factory=dict)
    head_stats: dict[str, float] = field(default_factory=dict)


class HFRunner:
    """transformers' own generate on the same checkpoint (the reference every user knows)."""

    def __init__(self, session: Session) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(session.folder, dtype=session.target.lm_head.weight.dtype)
        self.model.eval()
        self.stop_ids = session.stop_ids

    @torch.inference_mode()
    def __call__(self, ids: list[int], max_new: int, sampling: SamplingConfig) -> Run:
        x = torch.tensor([ids])
        kw: dict[str, Any] = {"do_sample": False}
        if not sampling.greedy:
            kw = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
            }
            torch.manual_seed(sampling.seed or 0)
        t0 = time.perf_counter()
        out = self.model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            eos_token_id=self.stop_ids,
            pad_token_id=self.stop_ids[0],
            **kw,
        )
        wall = time.perf_counter() - t0
        toks = out[0, len(ids) :].tolist()
        return Run(toks, wall, [1] * max(len(toks) - 1, 0))


def summarize(runs: list[Run], prompts: list[dict], ar_runs: list[Run] | None, greedy: bool) -> dict[str, Any]:
    tps = [len(r.tokens) / r.wall_s for r in runs]
    acc = [a for r in runs for a in r.accept_lengths]
    out: dict[str, Any] = {
        "prompts": len(runs),
        "tokens_per_s": statistics.mean(tps),
        "tokens_per_s_median": statistics.median(tps),
        "new_tokens": sum(len(r.tokens) for r in runs),
        "tau": statistics.mean(acc) if acc else 1.0,
    }
    if ar_runs is not None and greedy:
        out["mismatches_vs_ar"] = sum(r.tokens != a.tokens for r, a in zip(runs, ar_runs, strict=True))
    timers: dict[str, float] = {}
    rounds = sum(len(r.accept_lengths) for r in runs) or 1
    for r in runs:
        for k, v in r.timers_ms.items():
            timers[k] = timers.get(k, 0.0) + v
    out["round_ms"] = {k: v / rounds for k, v in timers.items() if k != "prefill"}
    stats: dict[str, list[float]] = {}
    for r in runs:
        for k, v in r.head_stats.items():
            stats.setdefault(k, []).append(v)
    if stats:
        out["head_stats"] = {k: statistics.mean(v) for k, v in stats.items()}
    return out


def run_bench(
    session: Session,
    prompts: list[dict[str, Any]],
    methods: list[str],
    drafter_spec: str = "demo",
    max_new_tokens: int = 64,
    sampling: SamplingConfig | None = None,
    tree: TreeConfig | None = None,
    progress: bool = True,
    warmup: int = 1,
) -> dict[str, Any]:
    from .pipeline import DEFAULT_TREE

    sampling = sampling or SamplingConfig()
    specs = [MethodSpec.parse(m, tree or DEFAULT_TREE) for m in methods]
    if len({s.name for s in specs}) != len(specs):
        raise SpecheadError("duplicate method names")
    runners = {}
    drafters: dict[str, Any] = {}
    for s in specs:
        if s.kind == "hf":
            runners[s.name] = HFRunner(session)
        elif s.kind == "ar":
            dec = session.decoder()
            runners[s.name] = _engine_runner(dec, speculative=False)
        else:
            arch = "eagle3" if s.head.startswith("eagle3") else "eagle2"
            drafter = drafters.setdefault(arch, resolve_drafter(drafter_spec, session.target, arch))
            runners[s.name] = _engine_runner(session.decoder(drafter, s.head, s.tree), speculative=True)
    encoded = [session.encode([{"role": "user", "content": p["turns"][0]}]) for p in prompts]
    for ids in encoded[:warmup]:
        for s in specs:
            runners[s.name](ids, min(16, max_new_tokens), sampling)
    results: dict[str, list[Run]] = {s.name: [] for s in specs}
    interrupted = False
    try:
        for ids in tqdm(encoded, desc="bench", disable=not progress, unit="prompt"):
            for s in specs:  # interleaved so machine drift hits every method alike
                results[s.name].append(runners[s.name](ids, max_new_tokens, sampling))
    except KeyboardInterrupt:
        interrupted = True
    n = min(len(v) for v in results.values())
    done = prompts[:n]
    ar_name = next((s.name for s in specs if s.kind == "ar"), None)
    ar_runs = results[ar_name][:n] if ar_name else None
    summary: dict[str, Any] = {}
    for s in specs:
        summary[s.name] = summarize(results[s.name][:n], done, ar_runs, sampling.greedy)
        cats: dict[str, list[Run]] = {}
        for p, r in zip(done, results[s.name][:n], strict=True):
            cats.setdefault(p["category"], []).append(r)
        summary[s.name]["per_category"] = {
            c: {k: v for k, v in summarize(rs, [], None, False).items() if k in ("tokens_per_s", "tau", "prompts")}
            for c, rs in cats.items()
        }
    if ar_name:
        for s in specs:
            summary[s.name]["speedup_vs_ar"] = summary[s.name]["tokens_per_s"] / summary[ar_name]["tokens_per_s"]
    hf_name = next((s.name for s in specs if s.kind == "hf"), None)
    if hf_name:
        for s in specs:
            summary[s.name]["speedup_vs_hf"] = summary[s.name]["tokens_per_s"] / summary[hf_name]["tokens_per_s"]
    return {
        "config": {
            "target": str(session.folder),
            "drafter": drafter_spec,
            "max_new_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "threads": torch.get_num_threads(),
            "tree": vars(tree or DEFAULT_TREE),
            "prompts": n,
            "interrupted": interrupted,
        },
        "methods": summary,
    }


def _engine_runner(dec, speculative: bool):
    def run(ids: list[int], max_new: int, sampling: SamplingConfig) -> Run:
        t0 = time.perf_counter()
        res = dec.generate(ids, max_new, sampling, speculative=speculative)
        wall = time.perf_counter() - t0
        return Run(res.tokens, wall, res.accept_lengths, res.timers_ms, res.head_stats)

    return run
