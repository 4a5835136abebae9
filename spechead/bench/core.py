"""End-to-end benchmark (``spechead bench``): methods side by side on the same prompts, interleaved, warm-up first.

Per method: tokens/s (mean over prompts of new tokens / wall time, Spec-Bench style, prefill
included; and decode-only, prefill excluded), tau (mean tokens committed per target forward),
speedups against ``ar`` and ``hf``, the per-round milliseconds of drafter backbone / head / gather /
verification, head telemetry (NanoSpec's active size and coverage), ``mismatches_vs_ar`` (greedy
prompts whose tokens differ from the engine's own AR output) and the memory each head holds.
Multi-turn prompts (MT-bench) run every turn: each method's own answer goes back into the
conversation, as in Spec-Bench. ``hf`` is transformers' ``generate`` on the same weights and thread
count, ``hf-pld`` its prompt-lookup decoding.

The speedup model (SlimSpec's): with kappa the full head's time over the rest of a round, a head
that takes nu times the full head's time and reaches rho_tau times its tau runs
rho_tau (1 + kappa) / (1 + nu kappa) times as fast (:func:`speedup_model`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spechead.decoding.guard import GuardConfig
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.session import AUTO_TREE, Session, demo_drafter_path, resolve_drafter
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.tuning.speedup import speedup_model
from spechead.tuning.tune import AUTO_TREE_HELP

SHARED_EVAL = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval"
SUITES = {"spec-bench": "spec_bench.jsonl", "humaneval": "humaneval.jsonl"}
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# Spec-Bench's six groups (the 8 MT-bench categories form one) plus HumanEval's "code".
GROUPS = ("MT", "translation", "summarization", "qa", "math_reasoning", "rag", "code")
PRESETS = {
    "main": "hf,hf-pld,ar,eagle,fr:8192,vocabtrim:8192,nanospec,hybrid,eagle3,lowrank",
    "sweep": "nanospec:512,nanospec:1024,nanospec:2048,nanospec:4096",
    "ablation": "nanospec:sources=ctx,nanospec:sources=ext",
}
LOWRANK_DEMO = "eagle3-lowrank72"  # the demo drafter trained with a rank-72 SlimSpec head
TIMER_KEYS = ("backbone", "head", "gather", "verify")
HEADS_DIR = Path(__file__).resolve().parents[2] / "results" / "heads"


# -- suites ----------------------------------------------------------------------------------------
def suite_path(suite: str) -> Path:
    if suite in SUITES:
        env = os.environ.get("SPECHEAD_EVAL_DIR")
        for base in ([Path(env)] if env else []) + [SHARED_EVAL, Path.cwd().parent / "shared" / "data" / "eval"]:
            if (base / SUITES[suite]).is_file():
                return base / SUITES[suite]
        raise SpecheadError(
            f"suite {suite} not found (expected ../shared/data/eval/{SUITES[suite]} or $SPECHEAD_EVAL_DIR)"
        )
    path = Path(suite)
    if not path.is_file():
        raise SpecheadError(f"suite file not found: {suite}")
    return path


def load_suite(
    suite: str, limit: int | None = None, categories: list[str] | None = None, limit_mt: int | None = None
) -> list[dict[str, Any]]:
    """Records with ``turns`` (and ``category``); ``limit`` applies per category, in file order, and
    ``limit_mt`` (default: ``limit``) to each MT-bench category, so that the MT group can get about as
    many prompts as the other groups. ``suite`` may list several suites (``spec-bench,humaneval``)."""
    rows: list[dict[str, Any]] = []
    for one in suite.split(","):
        rows += _load_one(one.strip(), limit, categories, limit if limit_mt is None else limit_mt)
    if not rows:
        raise SpecheadError(f"no prompts selected from {suite}" + (f" (categories {categories})" if categories else ""))
    return rows


def _load_one(
    suite: str, limit: int | None, categories: list[str] | None, limit_mt: int | None
) -> list[dict[str, Any]]:
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
        cap = limit_mt if cat in MT_BENCH else limit
        if cap is not None and per_cat.get(cat, 0) >= cap:
            continue
        per_cat[cat] = per_cat.get(cat, 0) + 1
        rows.append({"id": rec.get("question_id", rec.get("id", n)), "category": cat, "turns": turns})
    return rows


# -- methods ---------------------------------------------------------------------------------------
@dataclass
class MethodSpec:
    """``hf``, ``hf-pld[:N]``, ``ar``, ``eagle`` (full head), ``eagle3`` (the EAGLE-3 drafter, full head),
    ``lowrank[:R]`` (the low-rank drafter), or any head spec (``fr:N``, ``nanospec:W``, ``hybrid``...)
    on the EAGLE-2 drafter; ``@TREE`` overrides the draft tree."""

    name: str
    kind: str  # hf | pld | ar | spec
    head: str = "full"
    tree: TreeConfig | None = None
    drafter: str = "eagle2"  # eagle2 | eagle3 | lowrank
    pld: int = 10

    @classmethod
    def parse(cls, spec: str, default_tree: TreeConfig | None) -> MethodSpec:
        """``default_tree`` None (or ``@auto``): the tree is the tuning for the method's drafter and head,
        resolved when its runner is built (``build_runners``)."""
        base, _, tree = spec.partition("@")
        t = TreeConfig.parse(tree) if tree and tree.strip() != AUTO_TREE else None if tree else default_tree
        name, _, arg = base.partition(":")
        if base in ("hf", "ar"):
            return cls(spec, base)
        if name == "hf-pld":
            if arg and not (arg.isdigit() and int(arg) > 0):
                raise SpecheadError(f"hf-pld:N needs a positive integer, got {arg!r}")
            return cls(spec, "pld", pld=int(arg) if arg else 10)
        if base == "eagle":
            return cls(spec, "spec", "full", t)
        if base == "eagle3":
            return cls(spec, "spec", "full", t, "eagle3")
        if name == "lowrank":
            return cls(spec, "spec", base, t, "lowrank")
        return cls(spec, "spec", base, t)

    @property
    def family(self) -> str:
        """The drafter whose full head this method is compared with: the low-rank drafter is EAGLE-3's twin."""
        return "eagle3" if self.drafter in ("eagle3", "lowrank") else "eagle2"

    def reference(self, specs: list[MethodSpec]) -> MethodSpec | None:
        """The full-head run of the same drafter family on the same tree, which the speedup model compares
        this method with (a method on another tree has another rest of the round)."""
        same = (r for r in specs if r.kind == "spec" and r.family == self.family and r.tree == self.tree)
        return next((r for r in same if r.head == "full"), None)


def check_methods(methods: list[str], tree: TreeConfig | None) -> list[MethodSpec]:
    """Parse every method before any model loads; an unknown name is a typo, not a method to skip."""
    from spechead.heads import HEADS

    specs = [MethodSpec.parse(m, tree) for m in methods]
    for s in specs:
        if s.kind == "spec" and s.head.partition(":")[0] not in HEADS:
            known = "hf, hf-pld, ar, eagle, eagle3, " + ", ".join(sorted(HEADS))
            raise SpecheadError(f"unknown method {s.name!r}; known: {known}, presets {', '.join(PRESETS)}")
    if len({s.name for s in specs}) != len(specs):
        raise SpecheadError("duplicate method names")
    return specs


def expand_methods(text: str) -> list[str]:
    """Method names with presets expanded; a method a preset repeats runs once, a name given twice is an error."""
    out: list[str] = []
    given = [m.strip() for m in text.split(",") if m.strip()]
    for m in given:
        if m not in PRESETS and given.count(m) > 1:
            raise SpecheadError(f"duplicate method {m!r}")
        for x in PRESETS[m].split(",") if m in PRESETS else [m]:
            if x not in out:
                out.append(x)
    return out


@dataclass
class Run:
    tokens: list[int]
    wall_s: float
    accept_lengths: list[int]
    timers_ms: dict[str, float] = field(default_factory=dict)
    head_stats: dict[str, float] = field(default_factory=dict)
    prefill_s: float = 0.0
    trace: list[dict[str, float]] = field(default_factory=list)  # NanoSpec/hybrid, per round of the first turn
    turns: int = 1
    mode_rounds: dict[str, int] = field(default_factory=dict)  # target forwards per mode (the engine's guard)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    def __add__(self, other: Run) -> Run:
        """Two turns of one prompt: tokens, times and rounds add up; the head's stats are the last turn's, the
        trace the first turn's (the head starts afresh on every request, so traces do not concatenate)."""
        timers = dict(self.timers_ms)
        for k, v in other.timers_ms.items():
            timers[k] = timers.get(k, 0.0) + v
        return Run(
            self.tokens + other.tokens,
            self.wall_s + other.wall_s,
            self.accept_lengths + other.accept_lengths,
            timers,
            other.head_stats or self.head_stats,
            self.prefill_s + other.prefill_s,
            self.trace or other.trace,
            self.turns + other.turns,
            _add_counts(self.mode_rounds, other.mode_rounds),
        )


def _add_counts(*counts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


Runner = Callable[[list[int], int, SamplingConfig], Run]


class HFRunner:
    """transformers' own generate on the same checkpoint (the reference every user knows); with
    ``pld`` > 0, its prompt-lookup decoding (n-gram drafts copied from the context)."""

    def __init__(self, session: Session, pld: int = 0, model=None) -> None:
        if model is None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(session.folder, dtype=session.target.lm_head.weight.dtype)
            model.eval()
        self.model, self.pld = model, pld
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
        if self.pld:
            kw["prompt_lookup_num_tokens"] = self.pld
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


def engine_runner(dec, speculative: bool) -> Runner:
    def run(ids: list[int], max_new: int, sampling: SamplingConfig) -> Run:
        t0 = time.perf_counter()
        res = dec.generate(ids, max_new, sampling, speculative=speculative)
        wall = time.perf_counter() - t0
        trace = list(getattr(dec.head, "trace", None) or []) if speculative else []
        return Run(
            res.tokens, wall, res.accept_lengths, res.timers_ms, res.head_stats, res.prefill_s, trace,
            mode_rounds=res.mode_rounds,
        )  # fmt: skip

    return run


def run_prompt(runner: Runner, prompt: dict[str, Any], encode, decode, max_new: int, sampling: SamplingConfig) -> Run:
    """Every turn of a prompt; the method's own earlier answers go back into the conversation."""
    messages: list[dict[str, str]] = []
    total: Run | None = None
    for turn in prompt["turns"]:
        messages.append({"role": "user", "content": turn})
        run = runner(encode(messages), max_new, sampling)
        messages.append({"role": "assistant", "content": decode(run.tokens)})
        total = run if total is None else total + run
    assert total is not None
    return total


# -- metrics ---------------------------------------------------------------------------------------
def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[Run], ar_runs: list[Run] | None = None, greedy: bool = True) -> dict[str, Any]:
    """Spec-Bench's aggregation: tokens/s per prompt, then the mean (and median) over prompts; tau
    pooled over every round; per-round milliseconds = phase total / rounds."""
    tps = [len(r.tokens) / r.wall_s for r in runs if r.wall_s > 0]
    # decode-only: each turn's first token comes out of its prefill
    dec = [max(len(r.tokens) - r.turns, 0) / (r.wall_s - r.prefill_s) for r in runs if r.wall_s - r.prefill_s > 0]
    acc = [a for r in runs for a in r.accept_lengths]
    out: dict[str, Any] = {
        "prompts": len(runs),
        "tokens_per_s": _mean(tps),
        "tokens_per_s_median": _median(tps),
        "new_tokens": sum(len(r.tokens) for r in runs),
        "tau": statistics.mean(acc) if acc else 1.0,
        "tau_median": _median([statistics.mean(r.accept_lengths) for r in runs if r.accept_lengths]),
        "decode_tokens_per_s": _mean(dec) if any(r.prefill_s for r in runs) else float("nan"),
        "decode_tokens_per_s_median": _median(dec) if any(r.prefill_s for r in runs) else float("nan"),
        "wall_s": sum(r.wall_s for r in runs),
        "prefill_ms": _mean([r.prefill_s * 1e3 for r in runs]),
        "rounds": sum(len(r.accept_lengths) for r in runs),
        "mode_rounds": _add_counts(*(r.mode_rounds for r in runs)),
    }
    # the speculative rounds' time: the guard's AR steps (timer "ar") are not rounds
    decode_ms = sum((r.wall_s - r.prefill_s) * 1e3 - r.timers_ms.get("ar", 0.0) for r in runs if r.prefill_s)
    out["decode_round_ms"] = decode_ms / out["rounds"] if out["rounds"] and decode_ms else float("nan")
    if ar_runs is not None and greedy:
        out["mismatches_vs_ar"] = sum(r.tokens != a.tokens for r, a in zip(runs, ar_runs, strict=True))
    timers: dict[str, float] = {}
    rounds = out["rounds"] or 1
    for r in runs:
        for k, v in r.timers_ms.items():
            timers[k] = timers.get(k, 0.0) + v
    out["round_ms"] = {k: v / rounds for k, v in timers.items() if k != "prefill"}
    stats: dict[str, list[float]] = {}
    for r in runs:
        for k, v in r.head_stats.items():
            stats.setdefault(k, []).append(v)
    if stats:
        out["head_stats"] = {k: _mean([x for x in v if x == x]) for k, v in stats.items()}
    return out


def group_of(category: str) -> str | None:
    return "MT" if category in MT_BENCH else None


def evolution(runs: list[Run], max_rounds: int = 256) -> dict[str, list[float]]:
    """Mean over prompts of the active size and the cumulative coverage at each decoding round."""
    active: list[list[float]] = []
    cover: list[list[float]] = []
    for r in runs:
        for i, t in enumerate(r.trace[:max_rounds]):
            if i == len(active):
                active.append([])
                cover.append([])
            active[i].append(t["active"])
            cover[i].append(t["coverage"])
    return {"active": [_mean(a) for a in active], "coverage": [_mean(c) for c in cover], "n": [len(a) for a in active]}


def _head_ms(m: dict[str, Any]) -> float:
    return m["round_ms"].get("head", 0.0) + m["round_ms"].get("gather", 0.0)


def add_speedup_model(summary: dict[str, Any], specs: list[MethodSpec]) -> dict[str, Any]:
    """kappa from each full-head reference run; nu, rho_tau, predicted and measured speedups per head method.

    A round's cost is its share of the decode time (wall - prefill, over rounds): the timed phases plus
    the untimed glue, which belongs to the rest. Then pooled decode speed = tau / round time, and the
    measured speedup (``measured``) differs from the prediction only where the rest of the round moved
    (``rest_ratio``). ``measured_mean`` is the ratio of Spec-Bench-style means of per-prompt decode speeds,
    ``measured_incl_prefill`` that of tokens/s with prefill. A head method without a full-head run of
    its drafter on its tree (``MethodSpec.reference``) is left out."""
    model: dict[str, Any] = {"kappa": {}, "methods": {}}
    for r in specs:
        m = summary.get(r.name)
        if r.kind == "spec" and r.head == "full" and m and m["rounds"] and _rest_ms(m) > 0:
            model["kappa"][r.name] = _head_ms(m) / _rest_ms(m)
    for s in specs:
        ref_spec = s.reference(specs) if s.kind == "spec" else None
        ref = ref_spec.name if ref_spec else None
        if ref is None or s.name == ref or ref not in model["kappa"] or not summary[s.name]["rounds"]:
            continue
        m, r = summary[s.name], summary[ref]
        kappa, nu = model["kappa"][ref], _head_ms(m) / _head_ms(r) if _head_ms(r) else float("nan")
        rho = m["tau"] / r["tau"]
        measured = rho * r["decode_round_ms"] / m["decode_round_ms"]
        pred = speedup_model(kappa, nu, rho)
        model["methods"][s.name] = {
            "reference": ref,
            "kappa": kappa,
            "nu": nu,
            "rho_tau": rho,
            "predicted": pred,
            "measured": measured,
            "measured_mean": m["decode_tokens_per_s"] / r["decode_tokens_per_s"],
            "measured_incl_prefill": m["tokens_per_s"] / r["tokens_per_s"],
            "error": pred / measured - 1 if measured else float("nan"),
            "rest_ratio": _rest_ms(m) / _rest_ms(r),  # the model assumes 1
        }
    return model


def _rest_ms(m: dict[str, Any]) -> float:
    """Decode time per round outside the head (drafter backbone, verification, untimed glue)."""
    return m["decode_round_ms"] - _head_ms(m)


# -- projection to the paper's shapes --------------------------------------------------------------
LLAMA31_8B = {"d": 4096, "V": 128256, "layers": 32, "ffn": 14336, "kv": 1024}


def _layer_params(c: dict[str, int]) -> int:
    d = c["d"]
    return 2 * d * d + 2 * d * c["kv"] + 3 * d * c["ffn"]


def _roofline_ms(params: int, tokens: int, bytes_per: int, gbps: float, gflops: dict[str, float]) -> float:
    """A forward of `tokens` tokens through `params` weights: the slower of reading them and multiplying."""
    rates = {int(k): v for k, v in gflops.items()}
    rate = rates[min(rates, key=lambda b: abs(b - tokens))]
    return max(params * bytes_per / gbps / 1e6, 2 * params * tokens / rate / 1e6)


def _headbench_ms(heads: dict[str, Any], key: str, batch: int) -> float | None:
    h = heads.get(key)
    if h is None:
        return None
    b = {int(k): v["ms"] for k, v in h["batches"].items()}
    if batch in b:
        return b[batch]
    lo = max((x for x in b if x < batch), default=None)
    hi = min((x for x in b if x > batch), default=None)
    if lo is None or hi is None:
        return b[min(b, key=lambda x: abs(x - batch))]
    return b[lo] + (b[hi] - b[lo]) * (batch - lo) / (hi - lo)  # linear in the batch between measured ones


def _headbench_key(spec: MethodSpec, heads: dict[str, Any]) -> str | None:
    name = spec.head.partition(":")[0]
    if spec.head == "full":
        return "full"
    if name in ("fr", "vocabtrim"):
        keys = sorted((k for k in heads if k.startswith(name + ":")), key=lambda k: int(k.split(":")[1]))
        return keys[-1] if keys else None  # the paper-size list (32768 of 128k)
    if name in ("nanospec", "hybrid", "lowrank"):
        return next((k for k in heads if k.startswith(name + ":")), None)
    return None


def project(summary: dict[str, Any], specs: list[MethodSpec], tree: TreeConfig, heads_json: Path) -> dict[str, Any]:
    """Speedups at Llama-3.1-8B shapes on the machine the head benchmark ran on.

    Assumptions (docs/bench.md): head ms per call are the head benchmark's (cold cache, its dtype and
    threads); a round is one root call at batch 1 plus depth calls at batch top_k; the rest of a
    round is a roofline estimate from the same file's copy bandwidth and GEMM rates: the target
    verifying ``max_rows`` tokens (the tree with a full lookup branch, the upper bound) through its
    non-embedding weights + LM head, and the drafter's decoder layer (+ fc) running depth + 1 times;
    tau ratios (rho_tau) and tau are the ones measured here on the demo model, which assumes
    acceptance transfers to the larger vocabulary."""
    data = json.loads(heads_json.read_text())
    shape = data["shapes"].get("llama3.1-8b")
    if shape is None:
        raise SpecheadError(f"{heads_json} has no llama3.1-8b shape")
    heads, gbps, rates = shape["heads"], shape["copy_GBps"], shape["gemm_GFLOPs_in_cache"]
    e = {"bf16": 2, "fp16": 2, "fp32": 4}[shape["dtype"]]
    c = LLAMA31_8B
    target_params = c["layers"] * _layer_params(c) + c["V"] * c["d"]
    drafter_params = _layer_params(c) + 2 * c["d"] * c["d"]
    verify = _roofline_ms(target_params, tree.max_rows, e, gbps, rates)
    ar_ms = _roofline_ms(target_params, 1, e, gbps, rates)
    backbone = (tree.depth + 1) * _roofline_ms(drafter_params, 1, e, gbps, rates)

    def head_round(key: str) -> float | None:
        one, many = _headbench_ms(heads, key, 1), _headbench_ms(heads, key, tree.top_k)
        return None if one is None or many is None else one + tree.depth * many  # draft_tree's calls

    full = head_round("full")
    rest = verify + backbone
    out: dict[str, Any] = {
        "source": str(heads_json),
        "machine": data.get("config", {}).get("cpu"),
        "threads": data.get("config", {}).get("threads"),
        "dtype": shape["dtype"],
        "round_ms": {"verify": verify, "backbone": backbone, "full_head": full, "ar_token": ar_ms},
        "kappa": full / rest if full else float("nan"),
        "methods": {},
    }
    for s in specs:
        ref_spec = s.reference(specs) if s.kind == "spec" and s.tree == tree else None
        if ref_spec is None:
            continue  # the projection's round is the run's tree
        key = _headbench_key(s, heads)
        h = head_round(key) if key else None
        ref = summary.get(ref_spec.name)
        if h is None or full is None or ref is None:
            continue
        m = summary[s.name]
        nu, rho = h / full, m["tau"] / ref["tau"]
        out["methods"][s.name] = {
            "headbench": key,
            "head_ms_per_round": h,
            "nu": nu,
            "rho_tau": rho,
            "speedup_vs_full_head": speedup_model(out["kappa"], nu, rho),
            "speedup_vs_ar": m["tau"] * ar_ms / (rest + h),
        }
    return out


# -- the run ---------------------------------------------------------------------------------------
def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """Current resident memory (Linux /proc; NaN elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return pages * resource.getpagesize() / 2**20


def build_runners(
    session: Session,
    specs: list[MethodSpec],
    drafters: dict[str, str],
    log: Callable[[str], None] = print,
    guard: bool = True,
) -> tuple[dict[str, Runner], dict[str, dict[str, Any]], dict[str, str]]:
    """One runner per method; methods that cannot be built here (a missing token list...) are skipped
    with their reason rather than failing the whole run."""
    runners: dict[str, Runner] = {}
    info: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    loaded: dict[str, Any] = {}
    hf_model = None
    for s in specs:
        before = rss_mb()
        try:
            if s.kind in ("hf", "pld"):
                runner = HFRunner(session, s.pld if s.kind == "pld" else 0, hf_model)
                hf_model = runner.model
                runners[s.name], info[s.name] = runner, {"kind": s.kind, "rss_added_mb": rss_mb() - before}
                continue
            if s.kind == "ar":
                runners[s.name] = engine_runner(session.decoder(), False)
                info[s.name] = {"kind": "ar", "rss_added_mb": rss_mb() - before}
                continue
            drafter, where = _drafter(session, s.drafter, drafters, loaded)
            head = s.head
            if s.drafter == "lowrank" and getattr(drafter, "low_rank_head", None) is None and head == "lowrank":
                d = drafter.head_weight(session.target)[0].shape[1]
                head = f"lowrank:{max(1, d // 8)}"  # no trained low-rank drafter: SVD factors at d/8
            tuned = None
            if s.tree is None:  # --tree auto: this drafter + head's tuning (measured now if not cached), once
                from spechead.tuning.tune import resolve

                tuned = resolve(session, drafter, head)
                s.tree = tuned.tree
            dec = session.decoder(drafter, head, AUTO_TREE if tuned else s.tree, GuardConfig(enabled=guard))
            runners[s.name] = engine_runner(dec, True)
            info[s.name] = {
                "kind": "spec",
                "head": type(dec.head).__name__ + f" ({head})",
                "drafter": where,
                "tree": vars(s.tree),
                "extra_bytes": int(dec.head.extra_bytes()),
                "drafter_bytes": sum(p.numel() * p.element_size() for p in drafter.parameters()),
                "rss_added_mb": rss_mb() - before,  # what building it added (a drafter counts once, first use)
            }
            info[s.name]["tree_spec"] = str(s.tree)
            if tuned is not None:  # the method keeps its name; its tree is here, in config.trees and in the table
                info[s.name]["tree_auto"] = {
                    "tree": str(tuned.tree),
                    "gather": tuned.gather,
                    "reason": tuned.reason,
                    "fallback": tuned.fallback,
                    "cache": str(tuned.path) if tuned.path else None,
                }
        except SpecheadError as e:
            skipped[s.name] = str(e)
            log(f"skipping {s.name}: {e}")
    return runners, info, skipped


def _drafter(session: Session, kind: str, specs: dict[str, str], cache: dict[str, Any]) -> tuple[Any, str]:
    """(drafter, where it came from) for eagle2 / eagle3 / lowrank; ``demo`` falls back to a seeded random
    drafter (tau ~ 1) while no trained demo drafter ships. Without a low-rank demo drafter, ``lowrank``
    decodes the EAGLE-3 drafter (its twin) with an SVD head, so the nu / rho_tau comparison stays fair."""
    if kind in cache:
        return cache[kind]
    spec = specs.get(kind, "demo")
    arch = specs.get("arch", "eagle2") if kind == "eagle2" else "eagle3"  # --arch eagle3: 'eagle' on EAGLE-3
    if spec == "demo" and kind == "lowrank" and demo_drafter_path(LOWRANK_DEMO) is None:
        drafter, where = _drafter(session, "eagle3", specs, cache)
        cache[kind] = (drafter, where + " (no low-rank drafter: SVD factors of its head)")
        return cache[kind]
    if spec == "demo":
        path = demo_drafter_path(LOWRANK_DEMO if kind == "lowrank" else arch)
        spec = str(path) if path else "random"
    where = spec if spec != "random" else f"random {arch} (seed 0)"
    cache[kind] = (resolve_drafter(spec, session.target, arch), where)
    return cache[kind]


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
) -> dict[str, Any]:
    """``guard``: speculative methods run with the engine's never-slower-than-AR guard, as users get them
    (their AR steps are left out of the per-round times the speedup model uses). ``tree``: a TreeConfig
    or spec for every method without its own ``@tree``, None for DEFAULT_TREE, or ``auto``: each (drafter,
    head)'s tuning, resolved once (``config.trees`` and each method's ``tree_spec`` say which tree it ran)."""
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
    results = bench_loop(runners, prompts, session.encode, session.decode, max_new_tokens, sampling, progress, warmup)
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
) -> dict[str, Any]:
    """Warm-up, then for every prompt every method in turn (interleaved, so machine drift hits all
    alike). A Ctrl-C keeps what finished: the prompts every method completed."""
    results: dict[str, list[Run]] = {name: [] for name in runners}
    interrupted, t0 = False, time.perf_counter()
    try:
        for p in prompts[:warmup]:
            for run in runners.values():
                one = {**p, "turns": p["turns"][:1]}
                run_prompt(run, one, encode, decode, min(16, max_new_tokens), sampling)
        bar = tqdm(prompts, desc="bench", disable=not progress, unit="prompt", file=sys.stderr)
        for p in bar:
            for name, run in runners.items():
                bar.set_postfix_str(f"{p['category']} {name}")
                results[name].append(run_prompt(run, p, encode, decode, max_new_tokens, sampling))
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
    speedup model, the projection, and per-prompt figures."""
    runs: dict[str, list[Run]] = results["runs"]
    n = min((len(v) for v in runs.values()), default=0)
    done = prompts[:n]
    ar_name = next((s.name for s in specs if s.kind == "ar"), None)
    hf_name = next((s.name for s in specs if s.kind == "hf"), None)
    ar_runs = runs[ar_name] if ar_name else None
    summary: dict[str, Any] = {}
    for s in specs:
        rs = runs[s.name]
        m = summarize(rs, ar_runs, sampling.greedy)
        m["method"] = s.kind if s.kind != "spec" else s.head
        if s.kind == "pld":  # generate() does not report its verification rounds
            m["tau"] = m["tau_median"] = float("nan")
        cats: dict[str, list[int]] = {}
        for i, p in enumerate(done):
            cats.setdefault(p["category"], []).append(i)
            if group_of(p["category"]):
                cats.setdefault(group_of(p["category"]), []).append(i)
        m["per_category"] = {}
        for c, idx in cats.items():
            cm = summarize([rs[i] for i in idx], [ar_runs[i] for i in idx] if ar_runs else None, sampling.greedy)
            keep = ("prompts", "tokens_per_s", "tokens_per_s_median", "decode_tokens_per_s", "tau", "round_ms")
            m["per_category"][c] = {k: v for k, v in cm.items() if k in keep or k in ("head_stats",)}
            if any(rs[i].trace for i in idx):
                m["per_category"][c]["evolution"] = evolution([rs[i] for i in idx])
        m["per_prompt"] = [
            {"tokens_per_s": r.tokens_per_s, "tau": _tau(r), "new_tokens": len(r.tokens), "wall_s": r.wall_s}
            for r in rs
        ]
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
    heads_json = heads_json or HEADS_DIR / "llama3.1-8b_bf16_t1.json"
    if n and heads_json.is_file():
        try:
            out["projection_llama3.1-8b"] = project(summary, specs, tree, heads_json)
        except (KeyError, ValueError, SpecheadError) as e:
            out["projection_llama3.1-8b"] = {"error": str(e)}
    return out


def _tau(r: Run) -> float:
    return statistics.mean(r.accept_lengths) if r.accept_lengths else 1.0


def _cpu_name() -> str:
    from spechead.tuning.measure import cpu_name

    return cpu_name()


# -- output ----------------------------------------------------------------------------------------
def format_table(out: dict[str, Any]) -> str:
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
        from spechead.bench.report import write_report

        path = write_report(out, Path(report_dir))
        print(f"wrote {path}", file=sys.stderr)


def round_robin(rows: list[dict]) -> list[dict]:
    """One prompt of each category in turn, so that a run stopped early (Ctrl-C) still covers every category."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("category", ""), []).append(r)
    return [r for tier in itertools.zip_longest(*groups.values()) for r in tier if r is not None]


def cmd_bench(args: argparse.Namespace) -> int:
    cats = args.categories.split(",") if args.categories else None
    prompts = round_robin(load_suite(args.suite, args.limit, cats, args.limit_mt))
    methods = expand_methods(args.methods)
    if not methods:
        raise SpecheadError("no methods given")
    tree = AUTO_TREE if args.tree is None or args.tree.strip() == AUTO_TREE else TreeConfig.parse(args.tree)
    check_methods(methods, None if tree == AUTO_TREE else tree)
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.seed)
    session = Session.open(args.target, args.max_len, compile=args.compile)
    drafters = {"arch": args.arch}  # --eagle3-drafter / --lowrank-drafter default to --drafter
    drafters.update({k: v for k, v in (("eagle3", args.eagle3_drafter), ("lowrank", args.lowrank_drafter)) if v})
    heads_json = Path(args.heads_json) if args.heads_json else None
    out = run_bench(
        session, prompts, methods, args.drafter, args.max_new_tokens, sampling, tree,
        progress=not args.quiet, warmup=args.warmup, drafters=drafters, heads_json=heads_json,
        guard=not args.no_guard,
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
    b = sub.add_parser("bench", help="benchmark methods side by side on a prompt suite")
    b.add_argument("--suite", default="spec-bench", help="spec-bench, humaneval, a JSONL file with 'turns', or a,b")
    b.add_argument("--limit", type=int, default=None, help="prompts per category")
    b.add_argument("--limit-mt", type=int, default=None, help="prompts per MT-bench category (default: --limit)")
    b.add_argument("--categories", default=None, help="comma-separated categories (MT = the 8 MT-bench ones)")
    b.add_argument(
        "--methods",
        default="hf,ar,eagle",
        help="comma-separated: hf, hf-pld[:N], ar, eagle, eagle3, lowrank, fr:N, vocabtrim:N, nanospec[:W[:k=v]], "
        "hybrid, any head spec, [@tree]; presets: " + "; ".join(f"{k} = {v}" for k, v in PRESETS.items()),
    )
    b.add_argument("--json", default=None, help="write results to this file")
    b.add_argument("--report", default=None, help="write a Markdown report with PNG plots into this folder")
    b.add_argument("--target", default="demo", help="demo, a HF model folder or a .gguf file")
    b.add_argument("--drafter", default="demo", help="EAGLE-2 drafter: demo, random or a folder")
    b.add_argument("--eagle3-drafter", default=None, help="drafter for 'eagle3' (default: --drafter)")
    b.add_argument(
        "--lowrank-drafter", default=None, help=f"drafter for 'lowrank' (default: --drafter; demo: {LOWRANK_DEMO})"
    )
    b.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"], help="kind of --drafter (for demo/random)")
    b.add_argument("--tree", default=AUTO_TREE, help=AUTO_TREE_HELP + "; auto is resolved per (drafter, head)")
    b.add_argument("--heads-json", default=None, help="head benchmark JSON for the 8B projection")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--max-len", type=int, default=4096, help="context limit (KV cache size)")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=None)
    b.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    b.add_argument("--compile", action="store_true", help="torch.compile the target for every engine method")
    b.add_argument("--warmup", type=int, default=1, help="prompts run (turn 1, 16 tokens) before timing")
    b.add_argument(
        "--no-guard", action="store_true", help="speculate every round (no fallback to AR when slower): raw speed"
    )
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    b.add_argument("--note", default=None, help="a line shown at the top of the report (e.g. 'smoke run')")
    b.set_defaults(func=cmd_bench)
