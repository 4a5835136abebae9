"""A tuning's outcome (tree, gather mode, AR step time) and the messages ``--tree auto`` says once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError, say_once


class TuneError(SpecheadError):
    """Tuning could not run here (the ``auto`` tree then falls back to the default)."""


def supports_gather(head: str) -> bool:
    """Whether the head takes NanoSpec's ``gather=sync|async`` option (nanospec, hybrid)."""
    from spechead.heads import HEADS

    return "gather" in getattr(HEADS.get(head.partition(":")[0]), "STR_OPTS", ())


def with_gather(head: str, gather: str | None) -> str:
    """The head spec with a tuned gather mode, unless the spec sets one or the head has none."""
    name, _, arg = head.partition(":")
    if gather is None or not supports_gather(head) or "gather=" in arg:
        return head
    return f"{head}:gather={gather}" if arg else f"{name}:gather={gather}"


@dataclass
class TuneResult:
    """What ``auto`` resolved to; a ``decoding.session.ResolvedTree`` for ``Session.decoder``."""

    tree: TreeConfig
    gather: str | None  # NanoSpec's gather mode, or None: the head's own default
    ar_step_s: float | None  # the measured AR step time (the engine guard's ``ar_step_s``)
    reason: str
    data: dict[str, Any] = field(default_factory=dict)  # everything measured (the cache file)
    path: Path | None = None
    measured: bool = False  # measured by this call (False: read from the cache)
    fallback: bool = False

    def head_spec(self, head: str) -> str:
        return with_gather(head, self.gather)

    @classmethod
    def from_data(cls, data: dict[str, Any], path: Path | None, measured: bool = False) -> TuneResult:
        choice, ar = data["choice"], data.get("ar") or {}
        step = ar.get("step_ms")
        tree, ar_step_s = TreeConfig.parse(choice["tree"]), step / 1e3 if step else None
        return cls(tree, choice.get("gather"), ar_step_s, choice["reason"], data, path, measured)


def fallback_result(why: str) -> TuneResult:
    """The default tree, said once: tuning must never stop decoding."""
    from spechead.decoding.session import DEFAULT_TREE

    say_once(f"spechead: --tree auto: {why}; using the default tree {DEFAULT_TREE}")
    return TuneResult(DEFAULT_TREE, None, None, f"fallback ({why})", fallback=True)
