"""The one exception type user errors raise: the CLI and the server turn it into a clear message."""

from __future__ import annotations


class SpecheadError(Exception):
    """An error caused by the user's input or files; the CLI prints it as one line."""
