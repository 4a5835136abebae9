"""The candidate trees, what they measured, their predicted speed, and the choice.

A candidate's decoded rounds give its acceptance (tau) and row counts; the machine's costs (``tuning.costs``)
price a round; the benchmark's speedup model turns both into tokens/s. Predicting from the parts rather than
timing the rounds directly keeps a noisy prompt or two from deciding between close candidates.
"""

from __future__ import annotations

import statistics
from typing import Any

from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.tuning.costs import DRAFTER_ROWS, MAX_ROWS
from spechead.tuning.result import TuneError

SHAPES = ("chain:1", "chain:2", "chain:3", "chain:4", "2x1x4", "2x2x5", "2x3x8", "2x4x8", "4x4x16")
LOOKUPS = (0, 8)
KEEP_FRAC = 0.95  # after MIN_PASSES, keep the MIN_KEEP best and any predicting this share of the best
MIN_KEEP = 5
SUMS = ("rounds", "accepted", "decode_s", "wall_s", "head_ms", "gather_ms")


def candidate_grid(shapes=SHAPES, lookups=LOOKUPS, max_rows: int = MAX_ROWS) -> list[TreeConfig]:
    """Every shape with every lookup branch that stays within spechead's kernel (``max_rows`` rows)."""
    out: list[TreeConfig] = []
    for shape in shapes:
        for lookup in lookups:
            t = TreeConfig.parse(shape + (f"+lookup:{lookup}" if lookup else ""))
            if t.max_rows <= max_rows and t not in out:
                out.append(t)
    if not out:
        raise SpecheadError(f"no candidate tree verifies at most {max_rows} tokens")
    return out


# -- a candidate's measurements ---------------------------------------------------------------------
def new_candidate(tree: TreeConfig) -> dict[str, Any]:
    sums = dict.fromkeys(("prompts", "rounds", "accepted"), 0) | dict.fromkeys(
        ("decode_s", "wall_s", "head_ms", "gather_ms"), 0.0
    )
    lists = {"verify_rows": [], "backbone_rows": [], "outputs": []}
    return {"tree": str(tree), "max_rows": tree.max_rows, **sums, **lists, "dropped_after": None}


def add_run(cand: dict[str, Any], run: dict[str, Any]) -> None:
    """Add one prompt's decoding (``calibrate.decode_run``) to a candidate."""
    cand["prompts"] += 1
    for k in SUMS:
        cand[k] += run[k]
    cand["verify_rows"] += run["verify_rows"]
    cand["backbone_rows"] += run["backbone_rows"]
    cand["outputs"].append(run["tokens"])


def per_round(runs: list[dict[str, Any]], key: str, scale: float = 1.0) -> float:
    return scale * sum(r[key] for r in runs) / max(sum(r["rounds"] for r in runs), 1)


def candidate_row(c: dict[str, Any]) -> dict[str, Any]:
    """What the cache keeps of a candidate: its sums, means and prediction, without the raw lists."""
    row = {k: v for k, v in c.items() if k not in ("outputs", "verify_rows", "backbone_rows", "pred")}
    row["tau"] = c["accepted"] / c["rounds"] if c["rounds"] else None
    row["verify_rows_mean"] = statistics.mean(c["verify_rows"]) if c["verify_rows"] else None
    row["backbone_rows_mean"] = statistics.mean(c["backbone_rows"]) if c["backbone_rows"] else None
    row["measured_round_ms"] = 1e3 * c["decode_s"] / c["rounds"] if c["rounds"] else None
    row["measured_tok_s"] = c["accepted"] / c["decode_s"] if c["decode_s"] > 0 else None
    row.update(c.get("pred", {}))
    return row


# -- the prediction ---------------------------------------------------------------------------------
def _table(costs: dict[str, Any], key: str) -> dict[int, float]:
    return {int(k): v for k, v in costs[key].items()}


def _head_round(costs: dict[str, Any], spec: str, tree: TreeConfig) -> float | None:
    entry = costs["heads"].get(spec) or {}
    per_k = entry.get(tree.top_k, entry.get(str(tree.top_k)))
    if not per_k:
        return None
    return per_k["root"] + tree.depth * per_k["level"]  # draft_tree: the root at 1 row, each level at top_k


def parts(cand: dict[str, Any], costs: dict[str, Any], head: str) -> dict[str, float]:
    """The modelled parts of one round (ms) of a candidate that has decoded (its row counts observed)."""
    tree = TreeConfig.parse(cand["tree"])
    verify, drafter, tree_ms = _table(costs, "verify_ms"), _table(costs, "drafter_ms"), _table(costs, "drafter_tree_ms")
    bb_rows = cand["backbone_rows"] or [1]
    v_rows = cand["verify_rows"] or [tree.total_tokens]
    out = {
        "backbone": statistics.mean(drafter[min(max(r, 1), DRAFTER_ROWS)] for r in bb_rows),
        "drafter": tree.depth * tree_ms[tree.top_k],
        "verify": statistics.mean(verify[min(max(r, 1), MAX_ROWS)] for r in v_rows),
    }
    h = _head_round(costs, head, tree)
    out["head"] = h if h is not None else cand["head_ms"] / max(cand["rounds"], 1)
    full = _head_round(costs, "full", tree)
    out["full_head"] = full if full is not None else out["head"]
    return out


def predict(cand: dict[str, Any], costs: dict[str, Any], head: str, overhead_ms: float) -> dict[str, Any]:
    """The benchmark's speedup model on this machine's costs: rest = catch-up + tree passes + verify + overhead,
    kappa = full head / rest, nu = head / full head, tokens/s = speedup_model(kappa, nu, tau) / (rest + full)."""
    from spechead.tuning.speedup import speedup_model

    p = parts(cand, costs, head)
    rest = max(p["backbone"] + p["drafter"] + p["verify"] + overhead_ms, 1e-6)
    kappa, nu = p["full_head"] / rest, p["head"] / p["full_head"] if p["full_head"] > 0 else 1.0
    tau = cand["accepted"] / cand["rounds"] if cand["rounds"] else 1.0
    return {
        "parts_ms": p,
        "kappa": kappa,
        "nu": nu,
        "predicted_round_ms": rest + p["head"],
        "predicted_tok_s": 1e3 * speedup_model(kappa, nu, tau) / (rest + p["full_head"]),
    }


def _residual(cand: dict[str, Any], costs: dict[str, Any], head: str) -> float:
    p = parts(cand, costs, head)
    return 1e3 * cand["decode_s"] / cand["rounds"] - (p["backbone"] + p["drafter"] + p["verify"] + p["head"])


def overhead(cands: list[dict[str, Any]], costs: dict[str, Any], head: str) -> float:
    """The per-round overhead no part models: the median over candidates of measured less modelled."""
    res = [_residual(c, costs, head) for c in cands if c["rounds"]]
    return statistics.median(res) if res else 0.0


# -- pruning and the choice -------------------------------------------------------------------------
def pace(cands: list[dict[str, Any]]) -> float:
    """Seconds one more prompt takes these candidates, at their pace so far."""
    return sum(c["wall_s"] / c["prompts"] for c in cands if c["prompts"])


def prune(cands, passes: int, left: int, bar, frac: float = KEEP_FRAC) -> None:
    """Drop the candidates predicting too little to win (their remaining steps leave the progress bar)."""
    live = [c for c in cands if c["dropped_after"] is None and c["rounds"]]
    ranked = sorted(live, key=lambda c: c["pred"]["predicted_tok_s"], reverse=True)
    if not ranked:
        return
    best = ranked[0]["pred"]["predicted_tok_s"]
    for c in ranked[MIN_KEEP:]:  # the best MIN_KEEP stay, and any within frac of the best
        if c["pred"]["predicted_tok_s"] < frac * best:
            c["dropped_after"] = passes
            bar.total -= left
    bar.refresh()


def choose(cands: list[dict[str, Any]], ar_tok_s: float) -> tuple[str, float | None, str]:
    """(tree, its predicted tokens/s, why): the fastest lossless candidate, or chain:1 if none beats AR."""
    ok = [c for c in cands if c["dropped_after"] is None and c["rounds"] and not c.get("mismatches")]
    if not ok:
        raise TuneError("no candidate tree decoded the calibration prompts exactly")
    ok.sort(key=lambda c: c["pred"]["predicted_tok_s"], reverse=True)
    best = ok[0]
    pred = best["pred"]["predicted_tok_s"]
    if pred > ar_tok_s:
        chosen = best["tree"]
        runner = f"; next {ok[1]['tree']} {ok[1]['pred']['predicted_tok_s']:.1f}" if len(ok) > 1 else ""
        reason = (
            f"highest predicted speed: {pred:.1f} tok/s = {pred / ar_tok_s:.2f}x AR ({ar_tok_s:.1f} tok/s), "
            f"tau {best['accepted'] / best['rounds']:.2f}{runner}"
        )
    else:
        chosen = str(TreeConfig.chain(1))
        pred = next((c["pred"]["predicted_tok_s"] for c in cands if c["tree"] == chosen and "pred" in c), None)
        reason = (
            f"no tree beats AR by the prediction (best {best['tree']} {best['pred']['predicted_tok_s']:.1f} "
            f"tok/s vs AR {ar_tok_s:.1f} tok/s): the AR-like chain:1, the cheapest speculation"
        )
    return chosen, pred, reason
