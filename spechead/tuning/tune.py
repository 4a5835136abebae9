"""Self-tuning (``spechead tune``): this machine's costs and the drafter's acceptance choose the draft tree.

``--tree auto``, the default of ``generate``, ``demo``, ``serve`` and ``bench``, is the cached tuning for
this machine + target + drafter + head + thread count, measured on first use (well under a minute for the
demo model on 2 threads, a progress bar on stderr) and cached as JSON under ``$SPECHEAD_CACHE/tune/``.
When tuning cannot run (``SPECHEAD_TUNE=off``, a context too short, an error) ``auto`` falls back to
``session.DEFAULT_TREE`` and says so on stderr, once. The decoding layer does not know the tuner: a session
opened with :func:`open_session` carries :func:`resolve` as its ``tree_resolver``.

What is measured (medians, in ms):

- costs (``tuning.costs``): a target decode step (1 row); a verification of n = 1..16 tree tokens (the
  target forward on n tokens under a tree mask, as the engine runs it; the step and the 16 sizes timed in
  interleaved sweeps, so that a shared host's drift does not tilt the table); a drafter catch-up pass at 1..10
  rows and a tree-level pass at top_k rows; every registered head's call (``heads.make_head``) at 1 row and
  at top_k rows; the AR step time (plain decoding, its glue included), which the engine's guard takes as
  ``ar_step_s``;
- acceptance (``tuning.calibrate``): every candidate tree decodes a small built-in calibration set (chat,
  code, math, translation, summarization; not the benchmark's prompts; chat-encoded, or for a base model text
  to continue of the same kinds) with the real engine, greedy, so
  only its acceptance matters (the output is the target's own). Prompts run as passes over the candidates;
  after two passes, all but the best (``MIN_KEEP``, and any within ``KEEP_FRAC`` of the best) are dropped,
  and no pass starts that would end past the time budget (``BUDGET_S``, or ``BUDGET_STEPS`` AR steps of a slower
  target, at most ``CAP_S``: the first pass always runs, with
  fewer tokens per prompt on a machine too slow for it; the next one, if need be, with the best only).

The prediction (``tuning.predict``) is the benchmark's cost decomposition (``speedup.speedup_model``):
tokens/s = tau / round, round = rest + head, with rest = the catch-up pass (at the row counts seen) + depth
x a tree-level drafter pass + the verification (at the sizes seen, at most total_tokens + lookup) + a
measured per-round overhead (the median over candidates of the measured round time less the modelled
parts), and head = one call at 1 row + depth calls at top_k rows; with kappa = full head / rest and nu =
head / full head, tokens/s = speedup_model(kappa, nu, tau) / (rest + full head). The candidate predicting
the most tokens/s wins; if none predicts more than AR, the choice is the AR-like ``chain:1``. NanoSpec's
gather mode (sync or async) is measured on the winner both ways, interleaved, and async kept only if
clearly faster. The cache and its key are ``tuning.store``; the ``--show`` report is ``tuning.show``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from spechead.decoding.session import Session
from spechead.errors import SpecheadError, say_once
from spechead.tuning.calibrate import measure
from spechead.tuning.result import TuneError, TuneResult, fallback_result
from spechead.tuning.show import summary_line
from spechead.tuning.store import cache_key, cache_path, read_record, write_record

OFF_VALUES = ("0", "off", "no", "false")

_MEMO: dict[str, TuneResult] = {}  # cache key -> result, this process
_FAILED: dict[tuple, TuneResult] = {}  # (target, drafter, head, threads) -> the fallback, this process


def open_session(
    target: str = "demo", max_len: int = 4096, dtype: str | torch.dtype = "auto", compile: bool = False
) -> Session:
    """``Session.open`` with the tuner as its tree resolver: what every user-facing entry point opens, so that
    ``tree="auto"`` is this machine's tuning."""
    return Session.open(target, max_len, dtype=dtype, compile=compile, tree_resolver=resolve)


def with_tuner(session: Session) -> Session:
    """The same session (target, tokenizer, KV cache shared) with the tuner as its resolver, for code handed a
    session it did not open; the caller's object is left as it was."""
    return session if session.tree_resolver is resolve else dataclasses.replace(session, tree_resolver=resolve)


@contextlib.contextmanager
def _num_threads(threads: int | None) -> Iterator[int]:
    if threads is None:
        yield torch.get_num_threads()
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SpecheadError(f"threads must be a positive integer, got {threads!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def load_or_tune(
    session,
    drafter,
    head: str = "full",
    threads: int | None = None,
    force: bool = False,
    progress: bool = True,
    **settings: Any,
) -> TuneResult:
    """The cached tuning for this machine + target + drafter + head + threads, measured now when absent (or
    ``force``). ``settings`` go to ``calibrate.measure`` (new_tokens, prompts, budget_s, shapes, lookups)."""
    head = head.strip() or "full"
    with _num_threads(threads) as n:
        key, meta = cache_key(session, drafter, head, n)
        path = cache_path(key, head)
        if not force and (res := _cached(key, path)) is not None:
            return res
        data = measure(session, drafter, head, progress=progress, **settings)
        data["key"], data["meta"] = key, meta
        res = TuneResult.from_data(data, path, measured=True)
        try:
            write_record(path, data)
        except OSError as e:
            say_once(f"spechead: could not cache the tuning in {path}: {e}")
            res.path = None
        _MEMO[key] = res
        return res


def _cached(key: str, path: Path) -> TuneResult | None:
    if key in _MEMO:
        return _MEMO[key]
    data = read_record(path)
    if data is not None and data.get("key") == key and "choice" in data:
        try:
            res = _MEMO[key] = TuneResult.from_data(data, path)
            return res
        except (KeyError, TypeError, ValueError) as e:
            say_once(f"spechead: ignoring a malformed tuning cache {path} ({e}); tuning again")
    return None


def cached(session, drafter, head: str = "full", threads: int | None = None) -> TuneResult | None:
    """The cached tuning if there is one; never measures (the server's other heads, which must not stall
    the requests behind them for a minute of tuning)."""
    head = head.strip() or "full"
    with _num_threads(threads) as n:
        key, _ = cache_key(session, drafter, head, n)
        return _cached(key, cache_path(key, head))


def resolve(session, drafter, head: str = "full", threads: int | None = None, progress: bool = True) -> TuneResult:
    """What ``--tree auto`` means: the cached tuning, tuning now if absent; the default tree (said once on
    stderr) if tuning cannot run. A bad head spec is still the user's error (SpecheadError)."""
    if os.environ.get("SPECHEAD_TUNE", "").strip().lower() in OFF_VALUES:
        return fallback_result("tuning disabled by SPECHEAD_TUNE")
    failed = (id(session.target), id(drafter), head, threads or torch.get_num_threads())
    if failed in _FAILED:  # failed once in this process: not again for every decoder
        return _FAILED[failed]
    try:
        res = load_or_tune(session, drafter, head, threads, progress=progress)
    except TuneError as e:
        res = _FAILED[failed] = fallback_result(str(e))
    except SpecheadError:
        raise
    except Exception as e:  # a failed measurement must not stop decoding
        res = _FAILED[failed] = fallback_result(f"tuning failed ({type(e).__name__}: {e})")
    if res.measured and progress:
        say_once(f"spechead: --tree auto: {summary_line(res)}" + (f"; cached in {res.path}" if res.path else ""))
    return res
