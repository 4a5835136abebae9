"""The checks of user-facing options, in one place: the Python API, the command line and the server's request
schema call these, so a value is refused alike wherever it comes from.

Each check takes the value and the name the caller knows the option by (``max_new_tokens`` in the API,
``max_tokens`` in an OpenAI request), returns the value to use (normalised: ``top_k=-1`` is 0, a tree spec its
``TreeConfig``), and raises ``SpecheadError`` with a message that names the option and with ``param`` set to
that name. Specs whose grammar belongs to the engine (heads, trees, drafters) are parsed by the engine's own
parsers; this module names the option in their errors. Nothing heavy is imported until a check needs it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spechead.errors import SpecheadError

if TYPE_CHECKING:
    from spechead.decoding.sampling import SamplingConfig
    from spechead.decoding.tree import TreeConfig

AUTO_TREE = "auto"  # the tree `spechead tune` measured fastest (decoding.session.AUTO_TREE)
METHODS = ("ar", "eagle")
MAX_BATCH = 64  # a KV cache holds max_len positions for every lane (64 x 2048 x 30 layers: 3.6 GB, demo)
MAX_TEMPERATURE = 2.0  # OpenAI's range


def _error(name: str, message: str) -> SpecheadError:
    """A SpecheadError for option ``name``: ``message`` with the name in front unless it already says it."""
    said = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", message)
    return SpecheadError(message if said else f"{name}: {message}", param=name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no integer


def integer(value: Any, name: str, low: int, high: int | None = None) -> int:
    """An integer in [low, high] (no upper bound where ``high`` is None)."""
    if not _is_int(value):
        raise _error(name, f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        want = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _error(name, f"{name} must be {want}, got {value}")
    return value


def number(value: Any, name: str, low: float, high: float, low_open: bool = False) -> float:
    """A number in [low, high], or (low, high] with ``low_open``; NaN is refused."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _error(name, f"{name} must be a number, got {value!r}")
    if not ((low < value if low_open else low <= value) and value <= high):
        raise _error(name, f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
    return float(value)


# -- decoding limits and sampling -------------------------------------------------------------------------------
def max_new_tokens(value: Any, name: str = "max_new_tokens") -> int:
    """Tokens to generate: at least 1 (the context bounds the rest, checked once the prompt is encoded)."""
    return integer(value, name, 1)


def temperature(value: Any, name: str = "temperature") -> float:
    """0 (greedy) to 2."""
    return number(value, name, 0.0, MAX_TEMPERATURE)


def top_p(value: Any, name: str = "top_p") -> float:
    """Nucleus mass in (0, 1] (1: off)."""
    return number(value, name, 0.0, 1.0, low_open=True)


def top_k(value: Any, name: str = "top_k") -> int:
    """The k most likely tokens, >= 0; 0 and vLLM's -1 mean off (returned as 0)."""
    if _is_int(value) and value == -1:
        return 0
    if _is_int(value) and value < 0:
        raise _error(name, f"{name} must be >= 0 (or -1 for off), got {value}")
    return integer(value, name, 0)


def seed(value: Any, name: str = "seed") -> int | None:
    """Any integer (reduced modulo 2**63), or None for a fresh random seed per request."""
    if value is None:
        return None
    if not _is_int(value):
        raise _error(name, f"{name} must be an integer, got {value!r}")
    return value % 2**63


def sampling(
    temperature: Any = 0.0, top_p: Any = 1.0, top_k: Any = 0, seed: Any = None, names: dict[str, str] | None = None
) -> SamplingConfig:
    """The sampling settings as the engine's ``SamplingConfig``; ``names`` renames options in messages (an
    OpenAI request's fields, say)."""
    from spechead.decoding.sampling import SamplingConfig

    values = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}
    return SamplingConfig(**{k: _SAMPLING[k](v, (names or {}).get(k, k)) for k, v in values.items()})


_SAMPLING = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed}


def max_batch(value: Any, name: str = "max_batch") -> int:
    """Requests decoded together: 1 to ``MAX_BATCH``."""
    return integer(value, name, 1, MAX_BATCH)


PRECISIONS = ("auto", "gguf", "q8", "q4", "fp32")


def precision(value: Any, name: str = "dtype") -> str:
    """What the target computes in: ``auto`` (``gguf`` for a GGUF target where a kernel build runs, else ``fp32``),
    ``gguf``, ``q8``, ``q4`` or ``fp32`` (``model.loading.target_precision`` checks it against the target)."""
    if value not in PRECISIONS:
        raise _error(name, f"unknown {name} {value!r}; expected one of {', '.join(PRECISIONS)}")
    return value


def threads(value: Any, name: str = "threads") -> int | None:
    """Torch CPU threads, >= 1, or None for torch's default (all cores)."""
    return None if value is None else integer(value, name, 1)


def max_len(value: Any, name: str = "max_len") -> int:
    """The context limit (KV cache size): at least 2 (a prompt token and a generated one)."""
    return integer(value, name, 2)


# -- what to load -----------------------------------------------------------------------------------------------
def _spec(value: Any, name: str, example: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _error(name, f"{name} must be a non-empty string such as {example!r}, got {value!r}")
    return value.strip()


def target(value: Any, name: str = "target") -> str:
    """A packaged model's name (``demo``, ``gemma3-270m``), a Hugging Face model folder or a ``.gguf`` file."""
    from spechead.model.loading import PACKAGED_TARGETS

    spec = _spec(value, name, "demo")
    if spec in PACKAGED_TARGETS:
        return spec
    path = Path(spec)
    if not path.exists():
        raise _error(name, f"target not found: {spec}")
    if not path.is_dir() and path.suffix != ".gguf":
        known = ", ".join(PACKAGED_TARGETS)
        raise _error(name, f"target must be one of {known}, a model folder or a .gguf file, got {spec}")
    return spec


def _parsed(check, value: Any, name: str, example: str) -> str:
    """``value`` through the engine's own parser ``check``, its error naming option ``name``."""
    try:
        return check(_spec(value, name, example))
    except SpecheadError as e:
        raise _error(name, str(e)) from None


def drafter(value: Any, name: str = "drafter") -> str:
    """``demo`` (the drafter shipped for the target), ``random[:ARCH]`` or a drafter folder."""
    from spechead.decoding.session import check_drafter_spec

    return _parsed(check_drafter_spec, value, name, "demo")


def method(value: Any, name: str = "method") -> str:
    """``ar`` (plain autoregressive decoding) or ``eagle`` (speculative, with a drafter and a head)."""
    if value not in METHODS:
        raise _error(name, f"unknown {name} {value!r}; expected {' or '.join(METHODS)}")
    return value


def head(value: Any, name: str = "head") -> str:
    """A draft head spec such as ``full``, ``fr:8192`` or ``nanospec:1024``: its name and options, no weights."""
    from spechead.heads.base import check_head_spec

    return _parsed(check_head_spec, value, name, "full")


def tree(value: Any, name: str = "tree") -> TreeConfig | str:
    """``auto`` (returned as is: the decoder resolves it), or a tree spec such as ``2x1x4+lookup:8`` or
    ``chain:4`` (returned as its ``TreeConfig``)."""
    from spechead.decoding.tree import TreeConfig

    if value is None or (isinstance(value, str) and value.strip() == AUTO_TREE):
        return AUTO_TREE
    if isinstance(value, TreeConfig):
        return value
    try:
        return TreeConfig.parse(_spec(value, name, AUTO_TREE))
    except ValueError as e:
        raise _error(name, str(e)) from None


# -- prompts ----------------------------------------------------------------------------------------------------
def prompt(value: Any, name: str = "prompt") -> str | list[dict[str, str]]:
    """A non-empty text, or a conversation: a non-empty list of ``{"role": str, "content": str}`` turns."""
    if isinstance(value, str):
        if not value.strip():
            raise _error(name, f"empty {name}")
        return value
    if isinstance(value, list) and value and all(_is_turn(t) for t in value):
        return value
    raise _error(name, f"{name} must be a non-empty string or a list of {{'role', 'content'}} turns, got {value!r:.60}")


def prompt_tokens(ids: list[int], max_len: int, name: str = "prompt") -> list[int]:
    """An encoded prompt that leaves room in a context of ``max_len`` tokens for at least one generated token."""
    if not ids:
        raise _error(name, f"empty {name} once encoded")
    if len(ids) >= max_len:
        raise _error(name, f"{name} of {len(ids)} tokens does not fit the context of {max_len} tokens")
    return ids


def _is_turn(turn: Any) -> bool:
    return isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
