"""Prompt suites: Spec-Bench and HumanEval by name, or any JSONL of records with ``turns``.

The one reader of suite files (:func:`read_suite`): the benchmark's prompts (:func:`load_suite`) and the
coverage study's records both come through it. Named suites live in an eval folder the caller passes
(the CLI's ``--eval-dir``); the library knows no default location.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spechead.errors import SpecheadError

SUITES = {"spec-bench": "spec_bench.jsonl", "humaneval": "humaneval.jsonl"}
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# Spec-Bench's six groups (the 8 MT-bench categories form one) plus HumanEval's "code".
GROUPS = ("MT", "translation", "summarization", "qa", "math_reasoning", "rag", "code")
EVAL_DIR_ENV = "SPECHEAD_EVAL_DIR"


def group_of(category: str) -> str | None:
    return "MT" if category in MT_BENCH else None


def in_categories(category: str, categories: list[str] | None) -> bool:
    """Whether a record of ``category`` is selected (``MT`` selects the 8 MT-bench categories)."""
    return not categories or category in categories or ("MT" in categories and category in MT_BENCH)


def suite_path(suite: str, eval_dir: Path | None = None) -> Path:
    """A named suite's file inside ``eval_dir``, or ``suite`` itself as a file path."""
    if suite in SUITES:
        if eval_dir is not None and (Path(eval_dir) / SUITES[suite]).is_file():
            return Path(eval_dir) / SUITES[suite]
        where = Path(eval_dir) / SUITES[suite] if eval_dir is not None else f"an eval folder with {SUITES[suite]}"
        raise SpecheadError(f"suite {suite} not found (expected {where}; set --eval-dir or ${EVAL_DIR_ENV})")
    path = Path(suite)
    if not path.is_file():
        raise SpecheadError(f"suite file not found: {suite}")
    return path


def read_suite(suite: str, eval_dir: Path | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) for every non-blank line of one suite; a line that is not a JSON object is
    the user's error, named by file and line."""
    for n, line in enumerate(suite_path(suite, eval_dir).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecheadError(f"{suite}:{n}: not a JSON record ({e})") from e
        if not isinstance(rec, dict):
            raise SpecheadError(f"{suite}:{n}: not a JSON record (a {type(rec).__name__})")
        yield n, rec


def load_suite(
    suite: str,
    limit: int | None = None,
    categories: list[str] | None = None,
    limit_mt: int | None = None,
    eval_dir: Path | None = None,
) -> list[dict[str, Any]]:
    """Records with ``turns`` (and ``category``); ``limit`` applies per category, in file order, and
    ``limit_mt`` (default: ``limit``) to each MT-bench category, so that the MT group can get about as
    many prompts as the other groups. ``suite`` may list several suites (``spec-bench,humaneval``), each with
    its own per-category limit after a colon (``spec-bench,humaneval:3``)."""
    rows: list[dict[str, Any]] = []
    for one in suite.split(","):
        name, sep, n = one.strip().rpartition(":")
        name, own = (name, int(n)) if sep and n.isdigit() else (one.strip(), None)
        cap = limit if own is None else own
        cap_mt = own if own is not None else limit if limit_mt is None else limit_mt
        rows += _load_one(name, cap, categories, cap_mt, eval_dir)
    if not rows:
        raise SpecheadError(f"no prompts selected from {suite}" + (f" (categories {categories})" if categories else ""))
    return rows


def _load_one(
    suite: str, limit: int | None, categories: list[str] | None, limit_mt: int | None, eval_dir: Path | None
) -> list[dict[str, Any]]:
    rows, per_cat = [], {}
    for n, rec in read_suite(suite, eval_dir):
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise SpecheadError(f"{suite}:{n}: 'turns' must be a non-empty list of strings")
        cat = rec.get("category", "default")
        if not in_categories(cat, categories):
            continue
        cap = limit_mt if cat in MT_BENCH else limit
        if cap is not None and per_cat.get(cat, 0) >= cap:
            continue
        per_cat[cat] = per_cat.get(cat, 0) + 1
        rows.append({"id": rec.get("question_id", rec.get("id", n)), "category": cat, "turns": turns})
    return rows


def round_robin(rows: list[dict]) -> list[dict]:
    """One prompt of each category in turn, so that a run stopped early (Ctrl-C) still covers every category."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("category", ""), []).append(r)
    return [r for tier in itertools.zip_longest(*groups.values()) for r in tier if r is not None]
