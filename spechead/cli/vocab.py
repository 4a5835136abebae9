"""``spechead freq`` / ``spechead vocabtrim``: the command line of the static draft vocabularies
(:mod:`spechead.training.vocab_lists`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from spechead.cli.args import add_drafter, add_max_len, add_target, add_threads, positive_int
from spechead.errors import SpecheadError
from spechead.heads.tokenmaps import vocab_dirs
from spechead.model.tokenizer import end_token_ids, load_tokenizer, model_vocab_size
from spechead.training.data import parse_data_spec, read_jsonl
from spechead.training.vocab_lists import (
    count_tokens,
    drafter_proposals,
    parse_sizes,
    rank_ids,
    record_prompt,
    write_lists,
)


def cmd_freq(args) -> int:
    files = [f for spec in args.data for f in _expand(spec)]
    tok = load_tokenizer(args.tokenizer)
    V = model_vocab_size(tok, args.tokenizer)
    sizes = parse_sizes(args.sizes, V)
    counts = count_tokens(tok, files, V, args.limit)
    ranked = rank_ids(counts.double(), first=end_token_ids(tok))
    out = Path(args.out) if args.out else vocab_dirs(V)[0]
    paths = write_lists("freq", ranked, sizes, out)
    total = int(counts.sum())
    for n, p in zip(sizes, paths, strict=True):
        covered = int(counts[torch.tensor(ranked[:n])].sum())
        print(f"{p}: {n} ids cover {covered / total:.2%} of {total} counted tokens")
    return 0


def cmd_vocabtrim(args) -> int:
    from spechead.decoding.session import Session, resolve_drafter

    if args.topk < 1:
        raise SpecheadError("--topk must be >= 1")
    prompts = []
    for spec in args.prompts:
        path_spec, per_file = parse_data_spec(spec)
        for path in _expand(str(path_spec)):
            found = 0
            for rec in read_jsonl(path, keys=None):
                if per_file is not None and found >= per_file:
                    break
                if (turns := record_prompt(rec)) is not None:
                    prompts.append(turns)
                    found += 1
    if args.limit is not None:
        prompts = prompts[: args.limit]
    if not prompts:
        raise SpecheadError("no prompts found: records need 'turns', 'messages', 'prompt' or 'text'")
    session = Session.open(args.target, args.max_len, args.dtype)
    V = session.target.config.vocab_size
    sizes = parse_sizes(args.sizes, V)
    drafter = resolve_drafter(args.drafter, session.target, args.arch)
    counts, mass, seen, hit = drafter_proposals(session, drafter, prompts, args.max_new_tokens, args.topk, 1024)
    ranked = rank_ids(counts.double(), tie_break=mass, first=end_token_ids(session.tokenizer))
    out = Path(args.out) if args.out else vocab_dirs(V)[0]
    paths = write_lists("vocabtrim", ranked, sizes, out)
    print(f"{len(prompts)} prompts, {seen} reply positions; the drafter's top-{args.topk} held the target's token")
    print(f"at {hit / max(seen, 1):.2%} of them; {int((counts > 0).sum())} distinct ids proposed (the rest of each")
    print("list is ranked by summed draft probability)")
    for p in paths:
        print(p)
    return 0


def _expand(spec: str) -> list[str]:
    """A file, or a folder (its *.jsonl and *.jsonl.gz files)."""
    p = Path(spec)
    if p.is_dir():
        files = sorted([*p.glob("*.jsonl"), *p.glob("*.jsonl.gz")])
        if not files:
            raise SpecheadError(f"no .jsonl or .jsonl.gz files in {p}")
        return [str(f) for f in files]
    if not p.is_file():
        raise SpecheadError(f"data file not found: {spec}")
    return [spec]


def add_cli(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("freq", help="FR-Spec: frequency-ranked token lists from a corpus (SGLang token-map format)")
    f.add_argument("--tokenizer", default="demo", help="demo, gemma3-270m, a model folder or a tokenizer.json")
    f.add_argument("--data", nargs="+", required=True, help="JSONL(.gz) files or folders: chat 'messages' or 'text'")
    f.add_argument("--sizes", default="8192,16384,32768", help="comma-separated list sizes")
    f.add_argument("--out", default=None, help="output folder (default: where fr:N looks)")
    f.add_argument("--limit", type=positive_int, default=None, help="records per file")
    f.set_defaults(func=cmd_freq)

    v = sub.add_parser("vocabtrim", help="VocabTrim: token lists from the drafter's own proposals on target replies")
    add_target(v)
    add_drafter(v)
    v.add_argument(
        "--prompts", nargs="+", required=True, help="JSONL(.gz) files or folders; FILE:N = its first N prompts"
    )
    v.add_argument("--sizes", default="8192,16384,32768", help="comma-separated list sizes")
    v.add_argument("--out", default=None, help="output folder (default: where vocabtrim:N looks)")
    v.add_argument("--limit", type=positive_int, default=None, help="number of prompts")
    v.add_argument("--max-new-tokens", type=int, default=128, help="length of each calibration reply")
    v.add_argument("--topk", type=int, default=4, help="drafter proposals counted per position (the tree's top_k)")
    add_max_len(v, 2048)
    add_threads(v)
    v.set_defaults(func=cmd_vocabtrim)
