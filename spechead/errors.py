"""The one exception type user errors raise (the CLI and the server turn it into a clear message), and the
one way a note reaches the user once per process."""

from __future__ import annotations

import sys

_SAID: set[str] = set()  # notes already printed in this process


class SpecheadError(Exception):
    """An error caused by the user's input or files; the CLI prints it as one line. ``param``: the option it is
    about, where it is about one (``spechead.options`` sets it; the server answers it as the 400's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def say_once(msg: str) -> None:
    """Print to stderr once per process: every decoder resolving ``auto`` must not repeat the same note."""
    if msg not in _SAID:
        _SAID.add(msg)
        print(msg, file=sys.stderr, flush=True)
