"""``spechead export``: a drafter with its head choice written for another engine (the format:
``spechead.integrations.vllm.export``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from spechead.cli.args import add_drafter, add_head, add_target
from spechead.errors import SpecheadError
from spechead.integrations.vllm.export import FORMATS, HEADS, VLLM_METHOD, export_vllm, keeps_request_state


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from spechead.decoding.session import Session, check_drafter_spec, resolve_drafter
    from spechead.heads.base import check_head_spec

    if args.format not in FORMATS:
        raise SpecheadError(f"unknown export format {args.format!r}; expected one of {', '.join(FORMATS)}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):  # the drafter it reads, or anything else
        raise SpecheadError(f"--out {out} already exists and is not an empty folder; export writes a new one")
    check_head_spec(args.head)  # before the target loads
    check_drafter_spec(args.drafter)
    session = Session.open(args.target, max_len=64, dtype=args.dtype)
    drafter = resolve_drafter(args.drafter, session.target, args.arch)
    with torch.no_grad():
        head = session.draft_head(drafter, args.head)
    out = export_vllm(drafter, head, args.head, out, getattr(drafter, "spechead_source", ""), args.lookup_first)
    print(f"wrote {out} ({args.head} head{', lookup first' if args.lookup_first else ''})")
    per_request = keeps_request_state(args.head, args.lookup_first)  # vLLM settings the plugin needs then
    print(
        "vLLM: LLM(TARGET, speculative_config={"
        f'"method": "{VLLM_METHOD[drafter.arch]}", "model": "{out.resolve()}", '
        f'"num_speculative_tokens": {1 if args.lookup_first else 3}, "use_local_argmax_reduction": True'
        + (', "disable_padded_drafter_batch": True}, enable_prefix_caching=False)' if per_request else "})")
        + "  # needs spechead installed (the plugin registers the drafter)"
    )
    return 0


def add_cli(sub) -> None:
    """The ``export`` subcommand."""
    e = sub.add_parser("export", help="write a drafter with its head choice for another engine (--format vllm)")
    e.add_argument("--format", default="vllm", help="vllm: a folder for speculative_config's model")
    e.add_argument("--out", required=True, help="folder to write")
    add_target(e)
    add_drafter(e)
    add_head(e, help=f"draft head: {', '.join(HEADS)} with their options, e.g. lowrank:72, fr:8192")
    e.add_argument(
        "--lookup-first",
        action="store_true",
        help="take each round's draft token from the request's context (prompt lookup) where it matches, the head's "
        "elsewhere (vLLM with num_speculative_tokens 1; spechead's tree chain:1+lookup-first)",
    )
    e.set_defaults(func=cmd_export)
