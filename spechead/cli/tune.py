"""``spechead tune``: measure this machine's costs and the drafter's acceptance, and cache the chosen tree."""

from __future__ import annotations

import argparse
import time

from spechead.cli.args import add_drafter, add_head, add_max_len, add_target, add_threads
from spechead.errors import SpecheadError


def cmd_tune(args: argparse.Namespace) -> int:
    from spechead.decoding.session import check_drafter_spec, resolve_drafter
    from spechead.heads.base import check_head_spec
    from spechead.tuning.show import format_show, summary_line
    from spechead.tuning.tune import load_or_tune, open_session

    if args.budget is not None and not args.budget > 0:
        raise SpecheadError(f"--budget must be > 0 seconds, got {args.budget}")
    check_head_spec(args.head)  # before the target loads
    check_drafter_spec(args.drafter)
    session = open_session(args.target, args.max_len, args.dtype)
    drafter = resolve_drafter(args.drafter, session.target, args.arch)
    settings = {"budget_s": args.budget} if args.budget is not None else {}
    t0 = time.perf_counter()
    res = load_or_tune(session, drafter, args.head, force=args.force, progress=not args.quiet, **settings)
    if args.show:
        print(format_show(res))
    else:
        how = f"measured in {time.perf_counter() - t0:.1f} s" if res.measured else "cached"
        print(f"{summary_line(res)}\n{how}: {res.path}")
    return 0


def add_cli(sub) -> None:
    """The ``tune`` subcommand."""
    from spechead.tuning.calibrate import BUDGET_S, BUDGET_STEPS, CAP_S

    t = sub.add_parser("tune", help="measure this machine's costs and the drafter's acceptance; pick the tree")
    add_target(t)
    add_drafter(t)
    add_head(t, help="draft head to tune for, e.g. full, nanospec, lowrank")
    add_threads(t)
    add_max_len(t)
    t.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"no acceptance pass ends past this many seconds of tuning (default: {BUDGET_S:g}, or "
        f"{BUDGET_STEPS} AR steps of a slower target, at most {CAP_S:g})",
    )
    t.add_argument("--show", action="store_true", help="print every measurement and why the tree was chosen")
    t.add_argument("--force", action="store_true", help="measure again even if a tuning is cached")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_tune)
