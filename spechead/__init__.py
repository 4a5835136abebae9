"""spechead: lossless speculative decoding on CPUs with a choice of draft LM heads.

``spechead.load(target, drafter=..., head=...)`` gives an ``LLM`` whose ``generate`` and ``stream`` decode prompts
(``spechead.api``); a bad option raises ``SpecheadError`` naming it. The API is imported on first use, so that
``import spechead`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spechead.errors import SpecheadError

if TYPE_CHECKING:
    from spechead.api import LLM, Completion, load

__all__ = ["LLM", "Completion", "SpecheadError", "load"]
_API = {"LLM", "Completion", "load"}


def __getattr__(name: str) -> Any:
    if name in _API:
        from spechead import api

        return getattr(api, name)
    raise AttributeError(f"module 'spechead' has no attribute {name!r}")
