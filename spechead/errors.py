"""The one exception type user errors raise (the CLI and the server turn it into a clear message), and the
one way a note reaches the user once per process."""

from __future__ import annotations

import sys

_SAID: set[str] = set()  # notes already printed in this process


class SpecheadError(Exception):
    """An error caused by the user's input or files; the CLI prints it as one line."""


def say_once(msg: str) -> None:
    """Print to stderr once per process: every decoder resolving ``auto`` must not repeat the same note."""
    if msg not in _SAID:
        _SAID.add(msg)
        print(msg, file=sys.stderr, flush=True)
