"""Draft LM heads: one interface that every head implements.

The drafter backbone produces hidden states; a head turns them into the top-k candidate tokens
(as *target* vocabulary ids) and their draft log-probabilities. The engine also shows every head
the request's prompt (with the target's logits over it, when the head asks for them) and, after
each verification round, the drafted tree and the target's logits at every tree node, so that
context-aware heads such as NanoSpec can adapt. Verification never uses the head, so no head can
change the output: that is what keeps every method lossless.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from spechead import kernels
from spechead.errors import SpecheadError
from spechead.kernels import row_topk_supported
from spechead.kernels.qlinear import QuantWeight
from spechead.kernels.quant import quantize
from spechead.timing import Timers

if TYPE_CHECKING:
    from spechead.model.config import ModelConfig
    from spechead.model.lowrank import LowRankLinear


class DraftHead:
    """Interface. Subclasses override ``topk`` and, when they adapt to context, ``begin``/``observe``.

    ``weight`` is the drafter's LM-head matrix [V_draft, d]; ``row_ids`` maps its rows to target ids
    (None for the identity, as with a full-vocabulary head); ``vocab_size`` is the target's V.

    Everything the engine, the tuner and the server need from a head is declared here: construction from a
    spec string (``from_spec``, with ``options`` parsing its argument without any weights, so a bad spec is
    refused before a model loads) and the request lifecycle (``begin``, ``observe``, ``topk``). What the head
    benchmark knows about each head lives beside it (``spechead.bench.head_costs``).
    """

    name = "head"
    needs_prompt_logits = False
    per_round = False  # state changes every round (observe): benchmarks time rounds, not single calls
    # takes a drafter's fitted low-rank head that sits beside a full one (EAGLE-2's lowrank_head.safetensors);
    # a drafter whose only head is low-rank (EAGLE-3 trained with one) hands its factors to every head
    takes_side_factors = False

    def __init__(self, weight: Tensor, row_ids: Tensor | None, vocab_size: int) -> None:
        self.weight = weight
        self.row_ids = row_ids
        self.vocab_size = vocab_size
        self.timers = Timers()

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def options(cls, arg: str) -> dict[str, Any]:
        """Constructor keywords from the spec's argument (``NAME:ARG``); raises SpecheadError on a bad one."""
        if arg:
            raise SpecheadError(f"head {cls.name!r} takes no argument (got {cls.name}:{arg})")
        return {}

    @classmethod
    def from_spec(
        cls, arg: str, weight: Tensor, row_ids: Tensor | None, vocab_size: int, factors: LowRankLinear | None = None
    ) -> DraftHead:
        """The head for ``NAME:ARG`` over a drafter's LM head; ``factors`` is the drafter's own low-rank
        head when it was trained with one (``weight`` is then their dense product)."""
        return cls(weight, row_ids, vocab_size, **cls.options(arg))

    # -- the request lifecycle ---------------------------------------------------------------------
    def prompt_logit_rows(self, n: int, target_cfg: ModelConfig) -> int:
        """How many of an n-token prompt's last rows the prefill computes the target's logits at (at least the
        last one, which the first token is chosen from); ``begin`` then receives those rows."""
        return n if self.needs_prompt_logits else 1

    def begin(self, prompt_ids: Tensor, prompt_logits: Tensor | None) -> None:
        """A new request: reset per-request state. ``prompt_logits`` is [P, V] if asked for."""

    def observe(self, tree_tokens: Tensor, node_logits: Tensor, committed: list[int]) -> None:
        """After verification: the tree's tokens [N] (root first), the target's logits [N, V] at every
        node, and the tokens this round committed (accepted drafts + bonus). Called before the
        drafter's next backbone pass, so work started here (e.g. an async gather) overlaps it."""

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Top-k of the draft distribution for states h [B, d]: (log-probs [B, k], target ids [B, k])."""
        raise NotImplementedError

    def reference_logits(self, h: Tensor) -> Tensor:
        """The logits the next ``topk(h, k)`` ranks, computed the plain way over the *target* vocabulary
        [B, V] (float32, -inf where the head cannot propose): the contract tests check ``topk`` against it."""
        raise NotImplementedError

    def dense_logits(self, h: Tensor, rows: Tensor | None = None) -> Tensor:
        """For ``reference_logits``: ``h @ weight[rows].T`` in float32 at the rows' target ids, -inf elsewhere."""
        rows = torch.arange(self.weight.shape[0], device=h.device) if rows is None else rows
        ids = rows if self.row_ids is None else self.row_ids[rows]
        out = torch.full((h.shape[0], self.vocab_size), float("-inf"), device=h.device)
        out[:, ids] = h.float() @ self.weight[rows].float().T
        return out

    def stats(self) -> dict[str, float]:
        """Per-request telemetry (active vocabulary size, coverage...)."""
        return {}

    def extra_bytes(self) -> int:
        """Memory this head holds beyond the drafter's own weights."""
        return 0


def parse_options(arg: str, ints: set[str], strs: set[str], positional: str | None = None) -> dict[str, Any]:
    """``[POSITIONAL][:key=value...]`` -> constructor keywords (ints parsed). Unknown keys are a user error."""
    kw: dict[str, Any] = {}
    for i, part in enumerate(p for p in arg.split(":") if p):
        if "=" not in part:
            if i != 0 or positional is None:
                raise SpecheadError(f"bad head option {part!r}: expected key=value")
            kw[positional] = _int_opt(positional, part)
            continue
        key, _, value = part.partition("=")
        if key in ints:
            kw[key] = _int_opt(key, value)
        elif key in strs:
            kw[key] = value
        else:
            raise SpecheadError(f"unknown head option {key!r}; known: {', '.join(sorted(ints | strs))}")
    return kw


def _int_opt(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise SpecheadError(f"{key} must be an integer, got {value!r}") from None


def fast_topk(x: Tensor, k: int, chunk: int = 128) -> tuple[Tensor, Tensor]:
    """Exact top-k of each row of x [B, V], values descending, faster than ``Tensor.topk`` on vocabulary-wide
    rows. Where spechead's kernels run, its one-pass kernel (``row_topk``); elsewhere: take the k best chunk
    maxima, then the top-k among those k chunks only.

    Why exact: fewer than k entries exceed the k-th largest value t, so fewer than k chunks have a
    maximum above t; the k chosen chunks are those plus chunks whose maximum equals t, which together
    hold at least k entries >= t. (Among tied values the indices may differ from ``topk``'s.)
    """
    B, V = x.shape
    if row_topk_supported(x, k):  # one streaming pass per row in C++ (kernels.py)
        vals, idx = kernels.row_topk(x.contiguous(), min(k, V))
        return vals.to(x.dtype), idx
    if V % chunk or V // chunk <= k:
        return x.topk(min(k, V), dim=-1)
    best = x.view(B, V // chunk, chunk).amax(-1).topk(k, dim=-1).indices  # [B, k] chunk ids
    cand = (best[:, :, None] * chunk + torch.arange(chunk, device=x.device)).view(B, k * chunk)
    top, i = x.gather(1, cand).topk(k, dim=-1)
    return top, cand.gather(1, i)


def topk_logprobs(logits: Tensor, k: int, index_map: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """log-softmax values of the top-k entries and their indices (``index_map[i]`` when a map is given:
    a head's row -> token id), without the full log-softmax."""
    if row_topk_supported(logits, k):  # fused in one pass per row (kernels.py)
        cpu_map = index_map is None or (index_map.dtype == torch.long and index_map.device.type == "cpu")
        fused_map = index_map.contiguous() if index_map is not None and cpu_map else None
        logp, idx = kernels.row_topk(logits.contiguous(), min(k, logits.shape[-1]), True, fused_map)
        return logp, idx if cpu_map else index_map[idx]
    logits = logits.float()
    top, idx = fast_topk(logits, k)
    logp = (top - torch.logsumexp(logits, dim=-1, keepdim=True)).clamp_max(0.0)
    return logp, idx if index_map is None else index_map[idx]


HEADS: dict[str, type[DraftHead]] = {}  # filled by register_head as spechead.heads imports each file


def register_head(name: str):
    """Class decorator: make a head available to ``make_head`` / ``--head NAME[:ARG]``."""

    def deco(cls: type[DraftHead]) -> type[DraftHead]:
        if name in HEADS and HEADS[name] is not cls:
            raise RuntimeError(f"two heads registered as {name!r}: {HEADS[name].__module__} and {cls.__module__}")
        cls.name = name
        HEADS[name] = cls
        return cls

    return deco


def head_class(spec: str) -> type[DraftHead]:
    """The registered class of a spec ``NAME[:ARG]``; an unknown name is a user error listing the known ones."""
    name = spec.partition(":")[0]
    if name not in HEADS:
        raise SpecheadError(f"unknown head {spec!r}; available: {', '.join(sorted(HEADS))}")
    return HEADS[name]


def check_head_spec(spec: str) -> str:
    """Validate ``spec`` without weights (name and options), so the CLI and the server refuse it early."""
    body, _ = split_precision(spec)
    head_class(body).options(body.partition(":")[2])
    return spec


HEAD_PRECISIONS = ("fp32", "q8", "q4")


def split_precision(spec: str) -> tuple[str, str | None]:
    """``nanospec:3072:q8`` -> (``nanospec:3072``, ``q8``): a head spec's last part may name the precision its
    matrix is held in (None: as the drafter's head is, the target's blocks for a quantized tied head)."""
    body, _, last = spec.rpartition(":")
    return (body, last) if body and last in HEAD_PRECISIONS else (spec, None)


def at_precision(weight: Tensor | QuantWeight, precision: str | None) -> Tensor | QuantWeight:
    """The head's matrix at ``precision``: fp32 rows, or 32-value blocks (``q8`` / ``q4``, quantized from the float
    values, or the blocks themselves where they already are that format). It changes what the head proposes,
    never the output."""
    if precision is None:
        return weight
    if isinstance(weight, QuantWeight):
        if weight.format == precision:
            return weight
        weight = weight.blocks().dequantize()
    if precision == "fp32":
        return weight.float()
    return QuantWeight.pack(quantize(weight.detach().float(), precision))


def make_head(
    spec: str,
    weight: Tensor | QuantWeight,
    row_ids: Tensor | None,
    vocab_size: int,
    factors: LowRankLinear | None = None,
) -> DraftHead:
    """Build a head from a spec such as ``full``, ``fr:8192``, ``nanospec:1024:policy=lru`` or ``full:q4``."""
    spec, precision = split_precision(spec)
    cls = head_class(spec)
    cls.options(spec.partition(":")[2])  # a bad option is refused before any weight is converted
    return cls.from_spec(spec.partition(":")[2], at_precision(weight, precision), row_ids, vocab_size, factors)
