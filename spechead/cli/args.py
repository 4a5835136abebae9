"""Argument groups every subcommand shares, defined once: target, drafter, head, tree, decoding limits,
sampling and threads. A subcommand adds the groups it needs; the help text and defaults stay the same
everywhere (``spechead generate --help`` and ``spechead serve --help`` describe ``--tree`` alike). Sampling and
length options are checked as they are parsed, by ``spechead.options`` (the API's and the server's checks)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from spechead import options
from spechead.errors import SpecheadError

AUTO_TREE_HELP = (
    "draft tree: 'auto' (default: the tree `spechead tune` measured fastest for this machine, target, drafter "
    "and head; tuned on first use, then cached), 'top_k,depth,total_tokens' or 'chain:N', optionally "
    "'+lookup:L' (a context-lookup branch of up to L tokens), or 'chain:N+lookup-first' (the chain's tokens "
    "from the context lookup where it matches: how vLLM's one chain uses it)"
)


def _int_in(text: str, low: int, high: int | None, want: str) -> int:
    """An integer in [low, high] from the command line, or argparse's usage error saying what was wanted."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port (0: one the system picks)."""
    return _int_in(text, 0, 65535, "a port in [0, 65535]")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_in(text, 0, None, "an integer >= 0")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_in(text, 1, None, "a positive integer")


def checked(check: Callable[[Any], Any], parse: Callable[[str], Any] = int) -> Callable[[str], Any]:
    """argparse type: the text read by ``parse`` (int or float), then ``check``ed (a ``spechead.options`` check);
    either's refusal is argparse's usage error."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            want = "an integer" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        try:
            return check(value)
        except SpecheadError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def add_target(p: argparse.ArgumentParser, precision: bool = True) -> None:
    """``--target`` and, for commands that decode (``precision``), ``--dtype``; training runs in fp32 / bf16."""
    p.add_argument("--target", default="demo", help="demo, a HF model folder or a .gguf file")
    if not precision:
        return
    p.add_argument(
        "--dtype",
        default="auto",
        type=checked(options.precision, str),
        help="what the target computes in: gguf (a GGUF file's own integer blocks, its default), q8 / q4 (a model "
        "folder quantized at load), fp32 (the default for a folder; exact parity with transformers)",
    )


def add_drafter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default="demo", help="demo, random or a drafter folder")
    p.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"], help="drafter kind for demo/random")


def add_head(p: argparse.ArgumentParser, help: str = "draft head, e.g. full, nanospec, lowrank") -> None:
    p.add_argument("--head", default="full", help=help)


def add_tree(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree", default="auto", help=AUTO_TREE_HELP)


def add_max_len(p: argparse.ArgumentParser, default: int = 4096) -> None:
    p.add_argument("--max-len", type=positive_int, default=default, help="context limit (KV cache size)")


def add_max_new_tokens(p: argparse.ArgumentParser, default: int) -> None:
    p.add_argument("--max-new-tokens", type=checked(options.max_new_tokens), default=default)


def add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=checked(options.temperature, float), default=0.0, help="0: greedy; up to 2")
    p.add_argument("--top-p", type=checked(options.top_p, float), default=1.0, help="nucleus mass in (0, 1]")
    p.add_argument("--top-k", type=checked(options.top_k), default=0, help="0 or -1: off")
    p.add_argument("--seed", type=checked(options.seed), default=None, help="for reproducible sampling")


def add_threads(p: argparse.ArgumentParser, type=positive_int) -> None:
    p.add_argument("--threads", type=type, default=None, help="torch CPU threads (default: all cores)")


def add_compile(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", action="store_true", help="torch.compile the target (one-time cost)")


def set_threads(n: int | None) -> None:
    """Apply ``--threads`` before any torch work."""
    if n:
        import torch

        torch.set_num_threads(n)
