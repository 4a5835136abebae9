"""The tuning pass: costs, the AR reference, every candidate tree decoding the calibration prompts, the choice.

Acceptance is measured with the real engine, greedy, so a candidate's output must equal AR's (a mismatch
excludes it): the tuning checks losslessness on the way. Prompts run as passes over the candidates within a
time budget; see ``tuning.tune`` for the whole procedure.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.model.tokenizer import has_chat_template
from spechead.tuning.costs import MAX_ROWS, Recorder, measure_costs
from spechead.tuning.predict import (
    LOOKUPS,
    SHAPES,
    add_run,
    candidate_grid,
    candidate_row,
    choose,
    new_candidate,
    overhead,
    pace,
    per_round,
    predict,
    prune,
)
from spechead.tuning.result import TuneError, supports_gather, with_gather
from spechead.tuning.store import TUNE_VERSION

CALIBRATION = (
    ("chat", "Give me three short tips for staying focused while working from home."),
    ("code", "Write a Python function is_palindrome(s) that ignores case and spaces, with a docstring."),
    (
        "math",
        "A shop sells pens at 3 dollars each and notebooks at 5 dollars each. What do 4 pens and 2 notebooks cost?",
    ),
    ("translation", "Translate to English: Le chat dort sur le canapé pendant que nous préparons le dîner."),
    (
        "summarization",
        "Summarize in one sentence: The city council met on Tuesday to discuss the new bike lanes. Residents said the "
        "lanes made cycling safer, but shop owners worried about losing parking spaces. The council agreed to test "
        "the lanes for six months before a final vote.",
    ),
)
# A base model (no chat template) is tuned on what it is used for, text to continue: asked the chat prompts above
# as raw text it rambles, its drafter's acceptance drops, and a tuner that sees that picks trees too small for real
# completions.
CALIBRATION_COMPLETION = (
    (
        "code",
        'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same both ways, ignoring case and '
        'spaces."""\n',
    ),
    ("chat", "Question: What are three short tips for staying focused while working from home?\nAnswer:"),
    (
        "math",
        "Question: A shop sells pens at 3 dollars each and notebooks at 5 dollars each. What do 4 pens and 2 notebooks "
        "cost?\nAnswer:",
    ),
    ("translation", "French: Le chat dort sur le canapé pendant que nous préparons le dîner.\nEnglish:"),
    (
        "summarization",
        "The city council met on Tuesday to discuss the new bike lanes. Residents said the lanes made cycling safer, "
        "but shop owners worried about losing parking spaces. The council agreed to test the lanes for six months "
        "before a final vote.\n\nSummary:",
    ),
)
# per calibration prompt: enough for acceptance to settle, few enough for two passes over the candidates in the budget
NEW_TOKENS = 24
MIN_TOKENS = 12  # what a slow machine still decodes per prompt (fewer when asked for fewer)
BUDGET_S = 45.0  # no acceptance pass that would end past this many seconds of tuning; gather adds ~4 runs
# ...or, for a slower target, past this many of its AR steps (BUDGET_S of 25-ms steps): one pass of every candidate
# over one prompt is a noisy sample, so a slower target gets the time for a second one
BUDGET_STEPS = 1800
# ...but never past this, so that a first use stays under a minute. Past it, a slow target's candidates are pruned to
# the best few after the first prompt instead of the second (``prune``)
CAP_S = 48.0
MIN_PASSES = 2  # prompts every candidate decodes before any is dropped for predicting too little (budget allowing)
AR_PROMPTS = 2
GATHER_PROMPTS = 2
GATHER_MARGIN = 0.02  # async gather must beat sync by this share of a round


def calibration_prompts(session, n: int) -> list[tuple[str, list[int]]]:
    """The built-in prompts: chat-encoded, or as text to continue for a base model; a session without a
    tokenizer (tests) gets their bytes as ids."""
    out = []
    vocab = session.target.config.vocab_size
    tokenizer = getattr(session, "tokenizer", None)
    chat = tokenizer is None or has_chat_template(tokenizer)
    for kind, text in (CALIBRATION if chat else CALIBRATION_COMPLETION)[:n]:
        if tokenizer is None:
            ids = [b % vocab for b in text.encode()][:48]
        else:
            ids = list(session.encode(text))  # a base model's one-turn prompt is its text (the completion format)
        out.append((kind, ids))
    return out


def decode_run(dec, rec: Recorder, ids: list[int], new_tokens: int, speculative: bool = True) -> dict[str, Any]:
    """One prompt through a real decoder: its tokens, rounds, acceptance, times and the row counts it ran."""
    res = dec.generate(ids, new_tokens, speculative=speculative)
    verify, backbone = rec.take()
    return {
        "tokens": res.tokens,
        "rounds": len(res.accept_lengths),
        "accepted": sum(res.accept_lengths),
        "decode_s": res.wall_s - res.prefill_s,
        "wall_s": res.wall_s,
        "verify_rows": verify,
        "backbone_rows": backbone,
        "head_ms": res.timers_ms.get("head", 0.0),
        "gather_ms": res.timers_ms.get("gather", 0.0),
    }


def measure(
    session,
    drafter,
    head: str = "full",
    progress: bool = True,
    new_tokens: int = NEW_TOKENS,
    prompts: int = len(CALIBRATION),
    budget_s: float | None = None,
    shapes=SHAPES,
    lookups=LOOKUPS,
) -> dict[str, Any]:
    """Measure and choose (see ``tuning.tune``). Returns the JSON-able record that gets cached."""
    from spechead.heads import HEADS

    if new_tokens < 4 or prompts < 1 or not (budget_s is None or budget_s > 0):
        got = f"got {new_tokens}, {prompts} and {budget_s}"
        raise SpecheadError(f"tuning needs new_tokens >= 4, prompts >= 1 and budget_s > 0 ({got})")
    main_head = session.draft_head(drafter, head)  # a bad head spec is the user's error, raised as such
    specs = sorted(HEADS) + ([head] if head not in HEADS else [])
    try:
        grid = candidate_grid(shapes, lookups)
        return _measure(session, drafter, head, main_head, specs, grid, progress, new_tokens, prompts, budget_s)
    except SpecheadError as e:
        if isinstance(e, TuneError):
            raise
        raise TuneError(f"cannot tune: {e}") from e


class _Calibration:
    """What one tuning's steps share: the target and drafter, the head, a real decoder (rebuilt only when the tree
    or the head changes), the row-count recorder and the progress bar."""

    def __init__(self, session, drafter, main_head, bar) -> None:
        self.session, self.drafter, self.main_head, self.bar = session, drafter, main_head, bar
        try:
            self.stop_ids = list(session.stop_ids)
        except Exception:  # a session without a tokenizer
            self.stop_ids = []
        self.rec = Recorder(session.target, drafter)
        self.current: dict[str, Any] = {}

    def tick(self, what: str) -> None:
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.update(1)

    def run(self, dec, ids: list[int], new_tokens: int, what: str, speculative: bool = True) -> dict[str, Any]:
        """One prompt through ``dec`` (``decode_run``), one step of the progress bar."""
        self.bar.set_postfix_str(what, refresh=False)
        out = decode_run(dec, self.rec, ids, new_tokens, speculative)
        self.bar.update(1)
        return out

    def decoder(self, c: dict[str, Any], head_obj=None):
        """The decoder for candidate ``c``'s tree with ``head_obj`` (default: the head being tuned)."""
        from spechead.decoding.decoder import Decoder

        head_obj = self.main_head if head_obj is None else head_obj
        tree = TreeConfig.parse(c["tree"])
        if self.current.get("tree") != tree or self.current.get("head") is not head_obj:
            self.current.update(tree=tree, head=head_obj)
            target, max_len = self.session.target, self.session.max_len
            self.current["dec"] = Decoder(target, self.drafter, head_obj, tree, max_len, self.stop_ids)
        return self.current["dec"]

    def ar_step(self, prompts: list[tuple[str, list[int]]], new_tokens: int) -> tuple[list[dict[str, Any]], float]:
        """AR's runs on the first prompts (the calibration outputs' reference) and its step in ms (the guard's)."""
        from spechead.decoding.decoder import Decoder

        ar_dec = Decoder(self.session.target, None, None, None, self.session.max_len, self.stop_ids)
        runs = [self.run(ar_dec, ids, new_tokens, f"ar {kind}", False) for kind, ids in prompts[:AR_PROMPTS]]
        tokens = sum(max(len(r["tokens"]) - 1, 0) for r in runs)
        return runs, 1e3 * sum(r["decode_s"] for r in runs) / max(tokens, 1)

    def acceptance(self, cands, prompts, new_tokens: int, costs, head: str, budget_s: float, t0: float) -> int:
        """The real engine decodes every prompt with every live candidate, pass by pass, while a pass fits the
        budget at the candidates' pace; after MIN_PASSES the candidates predicting too little are dropped.
        Returns the passes run."""

        def live() -> list[dict[str, Any]]:  # in order of verification size
            return sorted((c for c in cands if c["dropped_after"] is None), key=lambda c: c["max_rows"])

        passes = 0
        for i, (kind, ids) in enumerate(prompts):
            if i:  # another pass only if it fits the budget, at these candidates' pace so far
                if time.perf_counter() - t0 + pace(live()) > budget_s:
                    prune(cands, i, len(prompts) - i, self.bar, frac=float("inf"))  # the MIN_KEEP best, if that fits
                if time.perf_counter() - t0 + pace(live()) > budget_s:
                    self.bar.total -= (len(prompts) - i) * len(live())
                    break
            for c in live():
                add_run(c, self.run(self.decoder(c), ids, new_tokens, f"{kind} {c['tree']}"))
            passes, left = i + 1, len(prompts) - i - 1
            _refresh(cands, costs, head)
            if passes >= MIN_PASSES and left:
                prune(cands, passes, left, self.bar)
        return passes

    def close(self) -> None:
        self.current.clear()
        self.rec.close()
        self.bar.close()


def _refresh(cands: list[dict[str, Any]], costs: dict[str, Any], head: str) -> float:
    """Re-predict every candidate that has run; returns the per-round overhead the predictions use."""
    over = overhead([c for c in cands if c["rounds"]], costs, head)
    for c in cands:
        if c["rounds"]:
            c["pred"] = predict(c, costs, head, over)
    return over


@torch.inference_mode()
def _measure(session, drafter, head, main_head, specs, grid, progress, new_tokens, n_prompts, budget_s):
    t0 = time.perf_counter()
    prompts = calibration_prompts(session, n_prompts)
    longest = max(len(ids) for _, ids in prompts)
    if longest + new_tokens + 2 * MAX_ROWS + 8 > session.max_len:
        raise TuneError(f"the context of {session.max_len} tokens is too short for the calibration prompts")
    ks = sorted({1} | {t.top_k for t in grid})
    gather = supports_gather(head) and "gather=" not in head.partition(":")[2]
    steps = 1 + MAX_ROWS + 1 + len(specs) + min(AR_PROMPTS, len(prompts)) + len(grid) * len(prompts)
    steps += 2 * min(GATHER_PROMPTS, len(prompts)) if gather else 0
    bar = tqdm(total=steps, desc="tune", unit="step", file=sys.stderr, disable=not progress, leave=False)
    calib = _Calibration(session, drafter, main_head, bar)
    drafter_len = drafter.max_len
    try:
        costs = measure_costs(session, drafter, specs, ks, prompts[0][1], calib.tick)
        ar_runs, ar_step_ms = calib.ar_step(prompts, new_tokens)
        if budget_s is None:
            budget_s = min(CAP_S, max(BUDGET_S, BUDGET_STEPS * ar_step_ms / 1e3))
        # a slow machine decodes fewer tokens per prompt: a first pass over every candidate (each at about AR's
        # pace or faster) should take at most half the budget
        fit = int(0.5 * budget_s / (len(grid) * ar_step_ms / 1e3))
        new_tokens = max(min(new_tokens, MIN_TOKENS), min(new_tokens, fit))
        cands = [new_candidate(t) for t in grid]
        passes = calib.acceptance(cands, prompts, new_tokens, costs, head, budget_s, t0)
        overhead_ms = _refresh(cands, costs, head)
        _mark_mismatches(cands, ar_runs, passes, new_tokens)
        ar_tok_s = 1e3 / ar_step_ms
        chosen, pred, reason = choose(cands, ar_tok_s)
        gather_rec = gather_choice = None
        if gather:
            gather_choice, gather_rec = _tune_gather(calib, head, chosen, prompts, new_tokens)
            reason += (
                f"; gather {gather_choice} ({gather_rec['sync_round_ms']:.2f} ms/round sync, "
                f"{gather_rec['async_round_ms']:.2f} async)"
            )
        return {
            "version": TUNE_VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "elapsed_s": time.perf_counter() - t0,
            "head": head,
            "threads": torch.get_num_threads(),
            "settings": {
                "new_tokens": new_tokens,
                "prompts": [kind for kind, _ in prompts],
                "passes": passes,
                "budget_s": budget_s,
                "grid": [str(t) for t in grid],
            },
            "costs": costs,
            "ar": {"step_ms": ar_step_ms, "tok_s": ar_tok_s, "prompts": len(ar_runs)},
            "overhead_ms": overhead_ms,
            "candidates": [candidate_row(c) for c in cands],
            "gather": gather_rec,
            "choice": {"tree": chosen, "gather": gather_choice, "reason": reason, "predicted_tok_s": pred},
        }
    finally:
        calib.close()
        if drafter_len:  # the tuning's decoders resized the drafter's cache: back to what its decoders expect
            drafter.setup_cache(drafter_len)


def _mark_mismatches(cands: list[dict[str, Any]], ar_runs: list[dict[str, Any]], passes: int, new_tokens: int) -> None:
    """Count the outputs that differ from the reference: AR's where it ran, else the candidates' majority."""
    for j in range(passes):
        outs = [tuple(c["outputs"][j]) for c in cands if len(c["outputs"]) > j]
        ref = tuple(ar_runs[j]["tokens"][:new_tokens]) if j < len(ar_runs) else statistics.mode(outs)
        for c in cands:
            if len(c["outputs"]) > j and tuple(c["outputs"][j]) != ref:
                c["mismatches"] = c.get("mismatches", 0) + 1


def _tune_gather(
    calib: _Calibration, head: str, chosen: str, prompts: list[tuple[str, list[int]]], new_tokens: int
) -> tuple[str, dict[str, Any]]:
    """NanoSpec's gather: the chosen tree both ways, interleaved prompt by prompt; async only if clearly faster."""
    heads = {m: calib.session.draft_head(calib.drafter, with_gather(head, m)) for m in ("sync", "async")}
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    tree_c = {"tree": chosen}
    for kind, ids in prompts[:GATHER_PROMPTS]:
        for mode, h in heads.items():
            runs[mode].append(calib.run(calib.decoder(tree_c, h), ids, new_tokens, f"gather={mode} {kind}"))
    per = {m: per_round(rs, "decode_s", 1e3) for m, rs in runs.items()}
    choice = "async" if per["async"] < (1 - GATHER_MARGIN) * per["sync"] else "sync"
    return choice, {
        "sync_round_ms": per["sync"],
        "async_round_ms": per["async"],
        "sync_gather_ms": per_round(runs["sync"], "gather_ms"),
        "prompts": len(runs["sync"]),
        "choice": choice,
    }
