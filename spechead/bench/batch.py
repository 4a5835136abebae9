"""The batch study (``spechead bench --batch 1,2,4,8``): where speculation and each head still pay as batch grows.

Every method decodes the same prompts (first turns) with the batched decoder (``decoding.decoder``) at each
batch size: all requests are submitted at once and join as lanes free up (continuous batching). Per
(batch, method): total tokens/s (every token of every request over the wall time, prefills included),
per-request latency (submission to last token: p50 / p99) and time per output token, tau, and
``mismatches_vs_ar``: greedy requests whose output differs from the batch-1 AR output of the same prompt.

Unless ``--tree`` fixes one, each round's tree follows ``decoding.tree.batch_tree``: the rows a round spends
on drafts shrink as requests share it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from spechead.bench.methods import MethodSpec
from spechead.bench.runners import method_drafter
from spechead.decoding.decoder import Decoder
from spechead.decoding.guard import GuardConfig
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.session import DEFAULT_TREE, Session
from spechead.decoding.tree import TreeConfig, batch_tree
from spechead.errors import SpecheadError


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_batch_study(
    session: Session,
    prompts: list[list[int]],
    methods: list[MethodSpec],
    batches: list[int],
    drafters: dict[str, str],
    max_new_tokens: int = 64,
    sampling: SamplingConfig | None = None,
    tree: TreeConfig | None = None,
    log: Callable[[str], None] = print,
    repeats: int = 3,
    guard: bool = True,
) -> dict[str, Any]:
    """``guard``: speculative methods run with the batched decoder's never-slower-than-AR guard, as the server
    does (False: speculate in every round the tree rule allows). ``tree`` None: every round's tree by
    ``batch_tree`` over the batch-1 default for the requests in it (a method's own ``@TREE`` or ``tree`` is used
    as given in every round). Methods run one after the other per batch size, AR first (the reference, added if
    not given), interleaved ``repeats`` times: each figure is the median run, each ratio the median of the
    per-repeat ratios."""
    if any(b < 1 for b in batches):
        raise SpecheadError(f"batch sizes must be >= 1, got {batches}")
    for m in [m for m in methods if m.kind in ("hf", "pld", "llamacpp")]:
        log(f"skipping {m.name}: the batch study runs the engine's methods ({m.name} runs batch 1 here)")
    methods = [m for m in methods if m.kind not in ("hf", "pld", "llamacpp")]
    if not methods or methods[0].kind != "ar":  # AR first: every speedup is against it
        methods = [MethodSpec("ar", "ar")] + [m for m in methods if m.kind != "ar"]
    sampling = sampling or SamplingConfig()
    loaded: dict[str, Any] = {}
    reference = {}  # prompt index -> batch-1 AR tokens
    ar = session.decoder()
    for i, p in enumerate(prompts):
        reference[i] = ar.generate(p, max_new_tokens, sampling, speculative=False).tokens
    out: dict[str, Any] = {"batches": {}, "methods": [m.name for m in methods], "repeats": repeats}
    for b in batches:
        decs = {m.name: _decoder(session, m, b, tree, drafters, loaded, guard) for m in methods}
        for dec, _ in decs.values():
            dec.generate_batch(prompts[:b], 8, sampling)  # warm-up: every lane once
        runs: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
        for _ in range(repeats):  # methods interleaved, so that drift of the machine hits each alike
            for m in methods:
                runs[m.name].append(_timed(decs[m.name][0], prompts, max_new_tokens, sampling, reference))
        row: dict[str, Any] = {}
        for m in methods:
            rs = runs[m.name]
            best = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]  # the median run
            row[m.name] = {**best, "tree": decs[m.name][1], "tokens_per_s_runs": [r["tokens_per_s"] for r in rs]}
            if methods[0].kind == "ar":  # the median of the per-repeat ratios: each against AR of its own repeat
                ratios = [r["tokens_per_s"] / a["tokens_per_s"] for r, a in zip(rs, runs[methods[0].name], strict=True)]
                row[m.name]["speedup_vs_ar"] = statistics.median(ratios)
            v = row[m.name]
            log(f"batch {b:>3}  {m.name:<14} {v['tree']:<18} {v['tokens_per_s']:8.2f} tok/s  tau {v['tau']:.2f}"
                f"  vs ar {v.get('speedup_vs_ar', float('nan')):.2f}  mismatches {v['mismatches_vs_ar']}")  # fmt: skip
        full = next((m for m in methods if m.kind == "spec" and m.head == "full" and m.drafter == "eagle2"), None)
        if full is not None:
            for m in methods:
                if m.kind == "spec":
                    ratios = [
                        r["tokens_per_s"] / f["tokens_per_s"]
                        for r, f in zip(runs[m.name], runs[full.name], strict=True)
                    ]
                    row[m.name]["speedup_vs_full_head"] = statistics.median(ratios)
        out["batches"][str(b)] = row
    return out


def _timed(dec: Decoder, prompts: list[list[int]], max_new: int, sampling: SamplingConfig, reference) -> dict:
    """One timed pass of every prompt through ``dec`` (all submitted at once)."""
    dec.timers.reset()
    t0 = time.perf_counter()
    results = dec.generate_batch(prompts, max_new, sampling)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.tokens) for r in results)
    lat = [r.wall_s for r in results]
    spec = [r for r in results if r.accept_lengths]
    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "latency_p50_s": statistics.median(lat),
        "latency_p99_s": _percentile(lat, 0.99),
        "ms_per_token": 1e3 * statistics.median(r.wall_s / max(len(r.tokens), 1) for r in results),
        "tau": statistics.mean(r.tau for r in spec) if spec else 1.0,
        "ar_round_share": sum(r.mode_rounds.get("ar", 0) for r in results)
        / max(sum(sum(r.mode_rounds.values()) for r in results), 1),
        "round_ms": dict(dec.timers.ms),
        "mismatches_vs_ar": sum(r.tokens != reference[i] for i, r in enumerate(results)) if sampling.greedy else None,
    }


def _decoder(
    session: Session,
    m: MethodSpec,
    batch: int,
    tree: TreeConfig | None,
    drafters: dict[str, str],
    loaded: dict,
    guard: bool = True,
) -> tuple[Decoder, str]:
    """The batched decoder for method ``m`` at ``batch`` and the tree it drafts ('ar' when it does not)."""
    if m.kind == "ar":
        return session.decoder(max_batch=batch), "ar"
    drafter, _ = method_drafter(session, m.drafter, drafters, loaded)
    head = m.head
    if m.drafter == "lowrank" and getattr(drafter, "low_rank_head", None) is None and head == "lowrank":
        head = f"lowrank:{max(1, drafter.head_weight(session.target)[0].shape[1] // 8)}"
    fixed = m.tree or tree
    shape = str(fixed) if fixed else f"rule ({batch_tree(DEFAULT_TREE, batch) or 'ar'} when full)"
    return session.decoder(drafter, head, fixed or "auto", GuardConfig(enabled=guard), batch), shape


def format_batch_table(out: dict[str, Any]) -> str:
    cfg = out.get("config", {})
    lines = [
        f"{cfg.get('prompts')} prompts x {cfg.get('max_new_tokens')} new tokens, {cfg.get('threads')} threads, "
        f"CPU {cfg.get('cpu')}",
        f"{'batch':>5}  {'method':<14}{'tree':<20}{'tok/s':>8}{'vs ar':>7}{'vs full':>8}{'tau':>6}"
        f"{'p50 s':>7}{'p99 s':>7}{'ms/tok':>8}{'mismatch':>9}",
    ]
    nan = float("nan")
    for b, row in out["batches"].items():
        for name, v in row.items():
            lines.append(
                f"{b:>5}  {name:<14}{v['tree']:<20}{v['tokens_per_s']:>8.2f}{v.get('speedup_vs_ar', nan):>7.2f}"
                f"{v.get('speedup_vs_full_head', nan):>8.2f}{v['tau']:>6.2f}{v['latency_p50_s']:>7.2f}"
                f"{v['latency_p99_s']:>7.2f}{v['ms_per_token']:>8.1f}{str(v['mismatches_vs_ar']):>9}"
            )
    return "\n".join(lines)


def plot_batch_study(out: dict[str, Any], path) -> None:
    """Total tokens/s against batch size, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [int(b) for b in out["batches"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in out["methods"]:
        ax.plot(batches, [out["batches"][str(b)][name]["tokens_per_s"] for b in batches], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch (requests in flight)")
    ax.set_ylabel("total tokens/s")
    ax.set_title(f"batched decoding, {out.get('config', {}).get('cpu', '')}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
