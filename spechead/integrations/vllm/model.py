"""EAGLE drafters for vLLM whose draft head is one of spechead's heads.

vLLM's own drafter classes run the backbone (their attention, vLLM's paged KV cache, its kernels): for EAGLE-3
``Eagle3LlamaForCausalLM`` (speculative method ``eagle3``), for EAGLE-1/2 ``EagleLlamaForCausalLM`` (method
``eagle``, the target's own LM head shared in). A subclass of each replaces only the head, the same way
(``SpecheadDraftHead``). vLLM asks the drafter for a draft token in one of two ways:

- ``get_top_tokens(h)`` (with ``use_local_argmax_reduction``): the head's top-1 target id per row, straight from
  spechead's ``DraftHead.topk``: a subset head multiplies only its N rows and maps indices back through its id
  list; a low-rank head reads r(d + V) weights. No [B, V] row is ever written.
- ``compute_logits(h)`` (vLLM's default, and for sampled drafts): [B, V] logits, -inf where the head cannot
  propose: the full-width scatter vLLM's ``d2t`` path does, kept only for that fallback.

Which head: the ``spechead`` block of the drafter's config.json (``{"head": "lowrank"}``, ``"fr:token_list.pt"``,
...), written by ``spechead export --format vllm``. A low-rank head's factors are the checkpoint's
``lm_head.down.weight`` / ``lm_head.up.weight`` (config ``lm_head_rank``) in spechead's ``LowRankLinear``; a head
over the full matrix reads the checkpoint's ``lm_head.weight`` or, for a drafter tied to the target, the
target's head, which vLLM shares in after loading (so the head is built on its first call).

NanoSpec (``{"head": "nanospec..."}``) keeps one active vocabulary per request, from what the drafter's
``forward`` sees: the token ids vLLM feeds it (the prompt at prefill, then each round's accepted tokens with the
bonus token, then its own drafts; ``disable_padded_drafter_batch`` keeps rejected drafts and a neighbour's token out
of a request's rows). vLLM's hooks name no request, so a request is recognised by the first block of its KV cache
(the attention metadata vLLM sets for each drafter forward: rows per request, block table), which stays the
request's own while it runs: rows starting at position 0 begin its set, later rows extend it, and each draft row is
scored against its own request's set. Where no metadata is at hand (vLLM's profiling runs) one set serves all rows.
vLLM must run without prefix caching (checked at construction): a cached prefix starts a request past position 0
on a finished request's block. Not reachable in vLLM: the target's top-3 over the prompt and its top-k at the
drafted nodes (a proposer never sees the target's logits).

Lookup first (``"lookup_first": true`` in the block, ``spechead export --lookup-first``): each request also keeps
spechead's ``ContextLookup`` over the same token ids, keyed the same way, and a draft row takes the lookup's token
where the request's last 3 or 2 tokens occurred before (``compute_logits``: a one-hot row there, the draft's true
distribution, so sampled drafts stay lossless), the head's elsewhere: spechead's ``chain:1+lookup-first``. One
speculative token (a chain of one), checked at construction. The lookup's context lacks the prompt's first token,
which the drafter is never fed.

``has_own_lm_head`` is set only when the checkpoint holds a head: otherwise vLLM's proposer swaps in the
target's ``lm_head``, which is what a tied drafter wants; the spechead head is then built over it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor, nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

from spechead.decoding.tree import ContextLookup
from spechead.heads import DraftHead, make_head
from spechead.heads.nanospec import NanoSpecHead
from spechead.integrations.vllm.export import CONFIG_KEY, keeps_request_state
from spechead.model.lowrank import LowRankLinear

NANOSPEC_DEFAULTS = {"policy": "lru", "gather": "sync"}
HEAD_CALLS: dict[str, int] = {}  # head spec -> draft calls in this process (the integration test reads it)
SETS_BEGUN = [0]  # NanoSpec: per-request sets begun in this process (the integration test reads it)
LOOKUP_TOKENS = [0]  # lookup first: draft tokens the context lookup gave in this process (the test reads it)


class SpecheadDraftHead(nn.Module):
    """A spechead draft head in place of a vLLM EAGLE drafter's own: mixed in before the vLLM drafter class."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg = self.config
        opts = dict(getattr(cfg, CONFIG_KEY, None) or {})
        self.head_spec: str = opts.get("head", "full")
        self.nanospec = self.head_spec.partition(":")[0] == "nanospec"  # a head with state per request
        self.lookup_first = bool(opts.get("lookup_first"))  # a context lookup per request
        self.per_request = keeps_request_state(self.head_spec, self.lookup_first)
        self.folder = Path(vllm_config.speculative_config.draft_model_config.model)
        self.target_vocab = vllm_config.model_config.get_vocab_size()
        self.has_own_lm_head = False  # until load_weights finds a head in the checkpoint
        rank = getattr(cfg, "lm_head_rank", None)
        if rank:  # SlimSpec factors: spechead's module, not a [V, d] ParallelLMHead that would never be read
            self.lm_head = LowRankLinear(cfg.hidden_size, cfg.draft_vocab_size, int(rank))
        self._head: DraftHead | None = None
        self.head_calls = 0
        # NanoSpec: request key (its first KV-cache block) -> its head, least recently used first; each draft row's key
        self._sets: OrderedDict[int, NanoSpecHead] = OrderedDict()
        # one per running request (W_max x d packed rows and three [V] tables each, outside vLLM's memory profile);
        # a newcomer past the cap takes the least recently used set, a finished request's
        self._max_sets = vllm_config.scheduler_config.max_num_seqs
        self._lookups: OrderedDict[int, ContextLookup] = OrderedDict()  # request key -> its lookup, as _sets
        what = "nanospec head" if self.nanospec else "lookup-first drafter"
        if self.per_request and vllm_config.cache_config.enable_prefix_caching:
            raise ValueError(
                f"spechead's {what} inside vLLM needs enable_prefix_caching=False: a request whose prefix is "
                "cached starts past position 0 on a finished request's first block, so its state cannot be told apart"
            )
        k = vllm_config.speculative_config.num_speculative_tokens
        if self.lookup_first and k != 1:
            raise ValueError(f"spechead's lookup-first drafter drafts 1 token: num_speculative_tokens=1, not {k}")
        self._row_keys: list[int] = []

    # -- weights -------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        factors: dict[str, Tensor] = {}

        def backbone() -> Iterable[tuple[str, Tensor]]:
            for name, w in weights:
                if name.startswith("lm_head.") and isinstance(self.lm_head, LowRankLinear):
                    factors[name.removeprefix("lm_head.")] = w
                else:
                    yield name, w

        super().load_weights(backbone())  # sets has_own_lm_head when the checkpoint has lm_head.weight
        if factors:
            state = self.lm_head.state_dict()
            if set(factors) != set(state):
                raise ValueError(f"low-rank head needs {sorted(state)}, checkpoint has {sorted(factors)}")
            self.lm_head.load_state_dict({k: v.to(state[k].dtype) for k, v in factors.items()})
            self.has_own_lm_head = True

    # -- the head ------------------------------------------------------------------------------
    def spechead_head(self) -> DraftHead:
        """spechead's head over this drafter's LM head, built on first use: a tied drafter's head is the
        target's, which vLLM shares in only after ``load_weights``."""
        if self._head is None:
            with torch.no_grad():
                self._head = self._build_head()
        return self._head

    def _build_head(self) -> DraftHead:
        name, _, arg = self.head_spec.partition(":")
        if arg and not arg.lstrip("-").isdigit() and not Path(arg).is_absolute() and (self.folder / arg).is_file():
            arg = str(self.folder / arg)  # a token list shipped in the exported folder
        if name == "nanospec":  # sets are reused across requests (evict) and updated at the draft call
            defaults = [f"{k}={v}" for k, v in NANOSPEC_DEFAULTS.items() if f"{k}=" not in arg]
            arg = ":".join(([arg] if arg else []) + defaults)
        spec = f"{name}:{arg}" if arg else name
        row_ids = None
        if getattr(self, "draft_id_to_target_id", None) is not None:  # EAGLE-3's reduced vocabulary
            row_ids = self.draft_id_to_target_id + torch.arange(self.config.draft_vocab_size, device=self._device())
        if isinstance(self.lm_head, LowRankLinear):
            lr = self.lm_head.requires_grad_(False)
            return make_head(spec, lr.dense(), row_ids, self.target_vocab, lr)
        weight = self.lm_head.weight.detach()[: self.config.draft_vocab_size]  # vLLM pads the vocabulary
        return make_head(spec, weight, row_ids, self.target_vocab)

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def _count(self) -> None:
        self.head_calls += 1
        HEAD_CALLS[self.head_spec] = HEAD_CALLS.get(self.head_spec, 0) + 1

    def forward(
        self, input_ids: Tensor, positions: Tensor, hidden_states: Tensor, inputs_embeds: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        if input_ids is not None and self.per_request:
            self._observe_ids(input_ids, positions)
        return super().forward(input_ids, positions, hidden_states, inputs_embeds)

    def _observe_ids(self, input_ids: Tensor, positions: Tensor) -> None:
        """A request's context as vLLM shows it: its rows begin (at position 0) or extend its NanoSpec set and its
        lookup; without attention metadata, one set for all rows and no lookup (see the module docstring)."""
        spans = _request_spans()
        if spans is None:
            self._row_keys = []
            if self.nanospec:
                _feed(self.spechead_head(), input_ids, positions)
            return
        for key, a, b in spans:
            if self.nanospec:
                head = self._sets.pop(key, None)
                new = head is None
                if new:  # a new request: a fresh set, or the least recently used one's, reset
                    head = self._sets.popitem(last=False)[1] if len(self._sets) >= self._max_sets else self._new_set()
                SETS_BEGUN[0] += _feed(head, input_ids[a:b], positions[a:b], new)
                self._sets[key] = head
            if self.lookup_first:
                lookup = self._lookups.pop(key, None)
                if lookup is None or (b > a and int(positions[a]) == 0):  # a new request, or a prompt on its block
                    lookup = ContextLookup()
                    if len(self._lookups) >= self._max_sets:
                        self._lookups.popitem(last=False)
                lookup.extend(input_ids[a:b].tolist())
                self._lookups[key] = lookup
        self._row_keys = [key for key, _, _ in spans]

    def _looked_up(self, rows: int) -> list[int | None]:
        """Each draft row's token from its request's context lookup (None: no match, or no request known)."""
        keys = self._row_keys
        if not self.lookup_first or len(keys) != rows:
            return [None] * rows
        found = [next(iter(self._lookups[k].propose(1)), None) for k in keys]
        LOOKUP_TOKENS[0] += sum(t is not None for t in found)
        return found

    def _new_set(self) -> NanoSpecHead:
        with torch.no_grad():
            head = self._build_head()
        assert isinstance(head, NanoSpecHead)
        return head

    def _per_row(self, h: Tensor, score: Callable[[DraftHead, Tensor], Tensor]) -> Tensor:
        """``score`` of each draft row by its own request's head."""
        self._count()
        keys = self._row_keys
        if len(keys) != h.shape[0]:
            raise RuntimeError(f"nanospec: {h.shape[0]} draft rows for the {len(keys)} requests of the last forward")
        return torch.cat([score(self._sets[k], h[i : i + 1]) for i, k in enumerate(keys)])

    def get_top_tokens(self, hidden_states: Tensor) -> Tensor:
        """The head's top-1 target id per row [B] (greedy drafts with ``use_local_argmax_reduction``), or the
        context lookup's token where lookup first finds one."""
        if self.nanospec and self._row_keys:
            top = self._per_row(hidden_states, lambda head, h: head.topk(h, 1)[1][:, 0])
        else:
            self._count()
            top = self.spechead_head().topk(hidden_states, 1)[1][:, 0]
        found = self._looked_up(top.shape[0])
        rows = [i for i, t in enumerate(found) if t is not None]
        if rows:
            top = top.clone()
            top[rows] = torch.tensor([found[i] for i in rows], dtype=top.dtype, device=top.device)
        return top

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """[B, V] logits over the target vocabulary, -inf outside what the head can propose (vLLM's default
        path and sampled drafts; greedy drafts should go through ``get_top_tokens``); a row the context lookup
        drafts is one-hot on its token (the draft is that token with probability 1)."""
        if self.nanospec and self._row_keys:
            logits = self._per_row(hidden_states, lambda head, h: head.reference_logits(h)).to(hidden_states.dtype)
        else:
            self._count()
            logits = self.spechead_head().reference_logits(hidden_states).to(hidden_states.dtype)
        for i, t in enumerate(self._looked_up(logits.shape[0])):
            if t is not None:
                logits[i] = float("-inf")
                logits[i, t] = 0.0
        return logits


def _feed(head: DraftHead, ids: Tensor, positions: Tensor, new: bool = False) -> bool:
    """Begin ``head``'s set on a prompt (rows 0..n-1, or any rows of a request new to it), else extend it with the
    ids. Returns whether a set was begun."""
    assert isinstance(head, NanoSpecHead)
    n = positions.numel()
    if new or (n and int(positions[0]) == 0 and int(positions[-1]) == n - 1):
        head.begin(ids, None)
        return True
    head.extend(ids)
    return False


def _request_spans() -> list[tuple[int, int, int]] | None:
    """(request key, first row, end row) for each request in the current forward, from its attention metadata:
    the key is the request's first KV-cache block. None where there is none (profiling runs, other backends)."""
    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):  # micro-batches: one set for the forward (spans would name only the first)
        meta = meta[0] if len(meta) == 1 else None
    m = next(iter(meta.values()), None) if isinstance(meta, dict) else None
    starts, table = getattr(m, "query_start_loc", None), getattr(m, "block_table", None)
    if starts is None or table is None or table.dim() != 2:
        return None
    starts = starts.tolist()
    keys = table[: len(starts) - 1, 0].tolist()
    return list(zip(keys, starts[:-1], starts[1:], strict=True))


class SpecheadEagle3ForCausalLM(SpecheadDraftHead, Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 backbone with a spechead draft head."""


class SpecheadEagleForCausalLM(SpecheadDraftHead, EagleLlamaForCausalLM):
    """vLLM's EAGLE-1/2 backbone with a spechead draft head (over the target's LM head, or low-rank factors)."""
