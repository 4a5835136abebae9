"""Statistics over runs: Spec-Bench's aggregation (:func:`summarize`), NanoSpec's vocabulary evolution, and
the speedup model checked against the measurement (:func:`add_speedup_model`; the formula itself is
:func:`spechead.tuning.speedup.speedup_model`, shared with the tuner).

The speedup model (SlimSpec's): with kappa the full head's time over the rest of a round, a head
that takes nu times the full head's time and reaches rho_tau times its tau runs
rho_tau (1 + kappa) / (1 + nu kappa) times as fast.
"""

from __future__ import annotations

import statistics
from typing import Any

from spechead.bench.methods import MethodSpec
from spechead.bench.runs import Run, add_counts
from spechead.tuning.speedup import speedup_model


def _mean(xs: list[float]) -> float:
    return statistics.mean(xs) if xs else float("nan")


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def committed_past(accept_lengths: list[int], depth: int = 5) -> list[float]:
    """Share of rounds that committed more than k tokens, k = 1..depth: on a chain, the chance that its
    first k drafts were all accepted, so entry k / entry k-1 is the acceptance at depth k given the ones
    before (a round clipped by a stop or the budget counts as shorter)."""
    n = len(accept_lengths)
    return [sum(a > k for a in accept_lengths) / n for k in range(1, depth + 1)] if n else []


def summarize(runs: list[Run], ar_runs: list[Run] | None = None, exact: bool = True) -> dict[str, Any]:
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
        "mode_rounds": add_counts(*(r.mode_rounds for r in runs)),
        "committed_past": committed_past(acc),
    }
    # the speculative rounds' time: the guard's AR steps (timer "ar") are not rounds
    decode_ms = sum((r.wall_s - r.prefill_s) * 1e3 - r.timers_ms.get("ar", 0.0) for r in runs if r.prefill_s)
    out["decode_round_ms"] = decode_ms / out["rounds"] if out["rounds"] and decode_ms else float("nan")
    if ar_runs is not None and exact:  # outputs that must be AR's: greedy, or seeded sampling in the engine
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


def tau_of(r: Run) -> float:
    return statistics.mean(r.accept_lengths) if r.accept_lengths else 1.0
