"""The command line: ``spechead SUBCOMMAND``. Each subcommand group is one file here (bench, serve, tune, train,
vocab, heads, coverage; generate and demo in commands); shared options are defined once in args."""

from spechead.cli.commands import main

__all__ = ["main"]
