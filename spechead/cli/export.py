"""``spechead export``: a drafter with its head choice written for another engine (the format:
``spechead.integrations.vllm.export``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from spechead.cli.args import add_drafter, add_head, add_target
from spechead.errors import SpecheadError
from spechead.integrations.vllm.export import FORMATS, HEADS, VLLM_METHOD, export_vllm


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
    session = Session.open(args.target, max_len=64)
    drafter = resolve_drafter(args.drafter, session.target, args.arch)
    with torch.no_grad():
        head = session.draft_head(drafter, args.head)
    out = export_vllm(drafter, head, args.head, out, getattr(drafter, "spechead_source", ""))
    print(f"wrote {out} ({args.head} head)")
    print(
        "vLLM: LLM(TARGET, speculative_config={"
        f'"method": "{VLLM_METHOD[drafter.arch]}", "model": "{out.resolve()}", "num_speculative_tokens": 3, '
        '"use_local_argmax_reduction": True})  # needs spechead installed (the plugin registers the drafter)'
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
    e.set_defaults(func=cmd_export)
