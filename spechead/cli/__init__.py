"""The command line: ``spechead SUBCOMMAND``; every subcommand parses its options here or next to its implementation."""

from spechead.cli.commands import main

__all__ = ["main"]
