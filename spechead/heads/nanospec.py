"""NanoSpec: a per-request, context-built active vocabulary for the draft head.

NanoSpec (Chen et al., 2026) keeps, per request, a set of at most ``W_max`` token ids built from the
context: the prompt ids and the target's top-3 at the last prompt positions (Ctx, once), then after every
verification round the committed tokens, the target's top-k at every tree node and the drafted tree tokens
(Ext). Each draft call is a dense GEMM against a packed copy of only those rows of the drafter's head, a
log-softmax over the set, and a map back to vocabulary ids. Verification stays full-vocabulary, so the output
is unchanged; only the draft (and so the acceptance) can differ.

State lives on the head's device: ids [W_max], packed rows [W_max, d], a membership mask [V] and a
slot map [V]. Only new ids are gathered. The update is prepared in ``observe`` (called by the engine
right after verification, before the drafter's catch-up pass) and awaited by the first ``topk`` of
the next round: ``gather=sync`` runs it there, ``gather=async`` overlaps it with the drafter backbone (on
CUDA on a side stream + event, on the CPU in a worker thread); ``auto`` is async on CUDA and sync on the CPU,
and the tuner picks between the two per machine. The host learns the number of new ids once per round (one
sync, in the update); draft steps never synchronise.

Options (``nanospec[:W_MAX][:key=value...]``):

- ``policy``: what happens when the set is full: ``stop`` stops adding (new ids kept in priority order:
  committed tokens, target top-k, drafted tokens); ``lru`` evicts the slots whose token was least recently hit
  (seen among a round's candidates), never ones hit in the current round. Engines that reuse a head across
  requests (the vLLM plugin) run ``lru``.
- ``gather``: ``auto``, ``sync`` or ``async`` (above).
- ``ctx_topk``: the target's top-k per prompt row added at ``begin`` (0: the prompt ids only, and the prefill
  computes no extra logits).
- ``ext_from``: ``logits`` (the target's top-k at the tree nodes join the set) or ``tokens`` (committed and
  drafted tokens only: what an engine that shows the head token ids alone can feed, as vLLM does).

Unlike the reference code, Ctx reads only the real prompt rows, and the set never exceeds ``W_max``.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from spechead import kernels
from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead, fast_topk, parse_options, register_head, topk_logprobs
from spechead.kernels.linear import BlockedWeight
from spechead.kernels.qlinear import QuantWeight

if TYPE_CHECKING:
    from spechead.model.config import ModelConfig

DEFAULT_W_MAX = 3072
POLICIES = ("stop", "lru")
GATHERS = ("auto", "sync", "async")
EXT_FROM = ("logits", "tokens")
# Ctx rows: the prefill computes the target's logits at as many of the last prompt rows as keep the head's share of
# the prefill within CTX_HEAD_SHARE of the decoder blocks' work, and at most CTX_ROWS_CAP of them. Where the head is
# small against the blocks that is every row of a short prompt; where it dominates (a 262k vocabulary on a small
# model) every row would multiply the prefill's cost. The cap bounds what a long prompt pays: the target's guesses at
# earlier rows add ids the set rarely uses (docs/nanospec.md, "Ctx rows").
CTX_HEAD_SHARE = 1 / 3
CTX_ROWS_CAP = 64
# gather=auto on the CPU: the update runs at the first draft call, since a worker thread's hand-off costs about
# what it hides on a few cores (the tuner measures both on the machine and keeps async only where it is faster).
CPU_AUTO_GATHER = "sync"


@register_head("nanospec")
class NanoSpecHead(DraftHead):
    """Dynamic in-context active vocabulary (see the module docstring)."""

    needs_prompt_logits = True
    per_round = True
    INT_OPTS = {"ctx_topk"}
    STR_OPTS = {"policy", "gather", "ext_from"}
    ext_topk = 3  # the target's top-k per tree node that joins the set (Ext)

    def __init__(
        self,
        weight: Tensor,
        row_ids: Tensor | None,
        vocab_size: int,
        w_max: int | None = None,
        ctx_topk: int = 3,
        policy: str = "stop",
        gather: str = "auto",
        ext_from: str = "logits",
        pinned: Tensor | None = None,
    ) -> None:
        """``pinned``: ids held in the set for every request, never evicted (the hybrid's frequent tokens)."""
        super().__init__(weight, row_ids, vocab_size)
        if w_max is None:  # the paper's default, or the whole vocabulary of a smaller model
            w_max = min(DEFAULT_W_MAX, vocab_size)
        if not 0 < w_max <= vocab_size:
            raise SpecheadError(f"nanospec W_max must be in [1, {vocab_size}] (the vocabulary size), got {w_max}")
        if not 0 <= ctx_topk <= 64:
            raise SpecheadError(f"ctx_topk must be in [0, 64], got {ctx_topk}")
        if policy not in POLICIES:
            raise SpecheadError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if gather not in GATHERS:
            raise SpecheadError(f"gather must be one of {', '.join(GATHERS)}; got {gather!r}")
        if ext_from not in EXT_FROM:
            raise SpecheadError(f"ext_from must be one of {', '.join(EXT_FROM)}; got {ext_from!r}")
        self.w_max, self.ctx_topk, self.policy, self.ext_from = w_max, ctx_topk, policy, ext_from
        self.needs_prompt_logits = ctx_topk > 0
        dev = weight.device
        self.device = dev
        if gather == "auto":
            gather = "async" if dev.type == "cuda" else CPU_AUTO_GATHER
        self.gather = gather
        # target id -> drafter row (-1: outside the drafter's vocabulary, can never be added)
        if row_ids is None:
            if weight.shape[0] != vocab_size:
                raise SpecheadError(f"head has {weight.shape[0]} rows but the vocabulary has {vocab_size} ids")
            self.t2r = None
            self.eligible = None
        else:
            self.t2r = torch.full((vocab_size,), -1, dtype=torch.long, device=dev)
            self.t2r[row_ids.to(dev)] = torch.arange(row_ids.numel(), device=dev)
            self.eligible = self.t2r >= 0
        self.ids = torch.zeros(w_max, dtype=torch.long, device=dev)  # slot -> target id
        # slot -> head row, in the draft-GEMM kernel's layout where it runs (rows rewritten in place)
        if isinstance(weight, QuantWeight):  # a quantized head gathers its rows' blocks (4-8 bits a weight)
            self.packed: BlockedWeight | QuantWeight = QuantWeight.empty(w_max, weight.in_features, weight.format)
        else:
            self.packed = BlockedWeight(weight[:0], capacity=w_max)
        self.in_set = torch.zeros(vocab_size, dtype=torch.bool, device=dev)  # membership mask
        self.slot_of = torch.full((vocab_size,), -1, dtype=torch.long, device=dev)  # id -> slot (-1: absent)
        self.last_hit = torch.zeros(w_max + 1, dtype=torch.long, device=dev)  # slot -> round; [-1] is a trash slot
        self.n = 0
        self.n_pin = self._pin(pinned) if pinned is not None else 0
        self._pending: concurrent.futures.Future | Callable[[], None] | None = None
        self._ext_queue: list[Callable[[], Tensor]] | None = None  # sync gather: the Ext candidates not yet added
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream = torch.cuda.Stream(dev) if dev.type == "cuda" and gather == "async" else None
        self._event: torch.cuda.Event | None = None
        self._reset_counters()

    def prompt_logit_rows(self, n: int, target_cfg: ModelConfig) -> int:
        """The last rows whose head work stays within CTX_HEAD_SHARE of the blocks' prefill, at most CTX_ROWS_CAP."""
        if not self.needs_prompt_logits:
            return 1
        head_macs = target_cfg.vocab_size * target_cfg.hidden_size  # the target's head, which the prefill runs
        return max(1, min(n, CTX_ROWS_CAP, math.ceil(n * CTX_HEAD_SHARE * target_cfg.block_macs() / head_macs)))

    @classmethod
    def options(cls, arg: str) -> dict[str, Any]:
        """``[W_MAX][:key=value...]`` with the keys of INT_OPTS / STR_OPTS."""
        return parse_options(arg, cls.INT_OPTS, cls.STR_OPTS, positional="w_max")

    def _pin(self, ids: Tensor) -> int:
        """Pin distinct ids in slots [0, k): gathered once, never evicted, kept across requests. A static
        backstop for the tokens the context has not shown yet."""
        ids = ids.to(self.device).flatten()
        if ids.unique().numel() != ids.numel() or not ids.numel() < self.w_max:
            raise SpecheadError(f"pinned ids must be distinct and fewer than W_max = {self.w_max}")
        if self.eligible is not None and not bool(self.eligible[ids].all()):
            raise SpecheadError("pinned ids must be inside the drafter's vocabulary")
        k = ids.numel()
        self.ids[:k] = ids
        self.packed.write(torch.arange(k, device=self.device), self.weight[ids if self.t2r is None else self.t2r[ids]])
        return k

    # -- per-request state ----------------------------------------------------------------------
    def _reset_counters(self) -> None:
        self.round = 0
        self._rounds: list[tuple[int, int, Tensor]] = []  # (active size when drafted, committed, hits)
        self.dropped = 0  # new ids refused because the set was full
        self.evicted = 0

    def begin(self, prompt_ids: Tensor, prompt_logits: Tensor | None) -> None:
        """Reset the state and queue the Ctx update (awaited by the first draft call)."""
        self._wait()
        self.in_set.zero_()
        self.slot_of.fill_(-1)
        self.last_hit.zero_()
        self.n = self.n_pin
        if self.n_pin:
            pinned = self.ids[: self.n_pin]
            self.in_set[pinned] = True
            self.slot_of[pinned] = torch.arange(self.n_pin, device=self.device)
        self._reset_counters()
        prompt_ids = prompt_ids.to(device=self.device, dtype=torch.long).flatten()
        n = prompt_ids.numel()
        if prompt_logits is not None and not 0 < prompt_logits.shape[0] <= n:
            # the last rows (those prompt_logit_rows asked for, or all); never rows past the prompt
            raise ValueError(f"prompt_logits has {prompt_logits.shape[0]} rows for {n} prompt ids")

        def ctx() -> None:
            parts = [prompt_ids.flip(0)]  # most recent first
            if prompt_logits is not None and self.ctx_topk > 0:
                # the target's next-token guesses at the given prompt rows
                top = fast_topk(prompt_logits, min(self.ctx_topk, prompt_logits.shape[-1]))[1].flip(0).T
                parts = [top[0], parts[0], *top[1:]]  # top-1 guesses rank first under the overflow policy
            self._append(torch.cat(parts))

        self._launch(ctx)

    def observe(self, tree_tokens: Tensor, node_logits: Tensor, committed: list[int]) -> None:
        """Record coverage against the set as it stands, then queue the Ext update. With ``gather=sync`` and the
        ``stop`` policy the updates of rounds with no draft between them (the guard's AR stretches) merge into one
        at the next draft call: one set update, not one per decode step (under LRU each round keeps its own, so
        a round's hits stay its own)."""
        if self._ext_queue is None:
            self._wait()
        dev = self.device
        com = torch.tensor(committed, dtype=torch.long, device=dev)
        hits = self.in_set[com].sum()
        self._rounds.append((self.n, len(committed), hits))
        self.round += 1

        def ext() -> Tensor:
            parts = [com]
            if self.ext_from == "logits":  # the target's argmax at every node first, then its top-2..k
                parts.append(fast_topk(node_logits, min(self.ext_topk, node_logits.shape[-1]))[1].T.flatten())
            parts.append(tree_tokens.to(dev))
            return torch.cat(parts)

        if self.gather != "sync" or self.policy == "lru":
            self._launch(lambda: self._append(ext()))
            return
        if self._ext_queue is None:
            self._ext_queue = []
            self._launch(self._merged_ext)
        self._ext_queue.append(ext)

    def _merged_ext(self) -> None:
        queue, self._ext_queue = self._ext_queue or [], None
        self._append(torch.cat([ext() for ext in queue]))

    def extend(self, ids: Tensor) -> None:
        """Queue ids that entered the context, for an engine that shows the head token ids only (vLLM's drafter
        sees the prompt, the committed tokens and its own drafts, never the target's logits): one update of the
        set, counted as a round for LRU (vLLM calls it at every drafter pass, several a verification round)."""
        self._wait()
        self.round += 1
        cand = ids.to(device=self.device, dtype=torch.long).flatten()
        self._launch(lambda: self._append(cand))

    # -- the update -----------------------------------------------------------------------------
    def _launch(self, work: Callable[[], None]) -> None:
        if self.gather == "sync":
            self._pending = work  # run at the next draft call, inside the draft phase
        elif self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                work()
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        else:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nanospec-gather")

            def job() -> None:
                with torch.inference_mode():  # inference mode is thread-local
                    work()

            self._pending = self._pool.submit(job)

    def _wait(self) -> None:
        """Make the pending update visible to the caller's stream/thread."""
        pending, self._pending = self._pending, None
        if isinstance(pending, concurrent.futures.Future):
            pending.result()
        elif pending is not None:
            pending()
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None

    def _fresh(self, cand: Tensor) -> Tensor:
        """Distinct candidates not in the set (and inside the drafter's vocabulary), first occurrence order."""
        vals, order = cand.sort(stable=True)
        keep = ~self.in_set[vals]
        keep[1:] &= vals[1:] != vals[:-1]
        if self.eligible is not None:
            keep &= self.eligible[vals]
        return cand[order[keep].sort().values]  # the one host sync of the update

    def _append(self, cand: Tensor) -> None:
        """Add new ids under the overflow policy; refresh last-hit rounds; gather only the new rows."""
        if self.device.type == "cpu" and kernels.available():  # the steps of _update_state, in one C++ op
            new, slots, k, evicted = kernels.ops().active_set_add(
                cand.contiguous(), self.in_set, self.slot_of, self.ids, self.last_hit, self.eligible,
                self.n, self.n_pin, self.round, self.policy == "lru",
            )  # fmt: skip
        else:
            new, slots, k, evicted = self._update_state(cand)
        self.evicted += evicted
        self.dropped += k - slots.numel()
        if slots.numel():
            self.packed.write(slots, self.weight[new if self.t2r is None else self.t2r[new]])
        self.n = min(self.w_max, self.n + k)

    def _update_state(self, cand: Tensor) -> tuple[Tensor, Tensor, int, int]:
        """The reference steps of the update (``active_set_add`` does the same on the CPU): refresh
        last-hit rounds, pick the fresh ids, give them free slots and, under LRU, victims' slots, and
        write ids / mask / slot map / rounds. Returns (ids placed, their slots, fresh ids, evicted)."""
        if self.policy == "lru":  # a hit: the round's candidates touched an id already in the set
            self.last_hit[self.slot_of[cand]] = self.round  # absent ids (slot -1) hit the trash slot
            self.last_hit[-1] = 0
        new = self._fresh(cand)
        k = new.numel()
        room = self.w_max - self.n
        slots = torch.arange(self.n, self.n + min(k, room), device=self.device)
        evicted = 0
        if k > room and self.policy == "lru":
            age = self.last_hit[self.n_pin : self.n]  # pinned frequent tokens are never evicted
            victims = torch.sort(age, stable=True).indices[: k - room]
            victims = victims[age[victims] < self.round] + self.n_pin  # never evict what this round hit
            old = self.ids[victims]
            self.in_set[old] = False
            self.slot_of[old] = -1
            evicted = victims.numel()
            slots = torch.cat([slots, victims])
        new = new[: slots.numel()]
        self.ids[slots] = new
        self.in_set[new] = True
        self.slot_of[new] = slots
        self.last_hit[slots] = self.round
        return new, slots, k, evicted

    # -- drafting -------------------------------------------------------------------------------
    def _ready(self, h: Tensor) -> None:
        with self.timers("gather", h.device):
            self._wait()

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        self._ready(h)
        return self._set_topk(h, k)

    def _set_topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with self.timers("head", h.device):
            if self.n == 0:  # nothing in the set yet (no prompt id in the drafter's vocabulary): the full head
                return topk_logprobs(h @ self.weight.T, k, self.row_ids)
            return topk_logprobs(self.packed(h, self.n), k, self.ids)

    def reference_logits(self, h: Tensor) -> Tensor:
        """The drafter's logits on the active set (all rows before anything is known, as ``_set_topk``)."""
        self._wait()
        if self.n == 0:
            return self.dense_logits(h)
        ids = self.ids[: self.n]
        rows = ids if self.t2r is None else self.t2r[ids]
        return self.dense_logits(h, rows)

    # -- telemetry ------------------------------------------------------------------------------
    @property
    def trace(self) -> list[dict[str, float]]:
        """Per round: active size it was drafted with, tokens committed, how many were in the set, and the
        cumulative coverage so far (for vocabulary-evolution plots). Reading it synchronises once."""
        hits = torch.stack([r[2] for r in self._rounds]).tolist() if self._rounds else []
        trace, tot_c, tot_h = [], 0, 0
        for i, ((size, c, _), h) in enumerate(zip(self._rounds, hits, strict=True), 1):
            tot_c, tot_h = tot_c + c, tot_h + h
            trace.append({"round": i, "active": size, "committed": c, "hits": h, "coverage": tot_h / tot_c})
        return trace

    def stats(self) -> dict[str, float]:
        self._wait()
        t = self.trace
        out = {
            "active_size": float(self.n),
            "active_mean": sum(r["active"] for r in t) / len(t) if t else float(self.n),
            "coverage": t[-1]["coverage"] if t else math.nan,
            "rounds": float(len(t)),
            "dropped": float(self.dropped),
            "evicted": float(self.evicted),
        }
        return out

    def state(self) -> tuple[Tensor, int]:
        """(active ids, size): for tests and plots; waits for a pending update."""
        self._wait()
        return self.ids[: self.n].clone(), self.n

    def extra_bytes(self) -> int:
        b = self.packed.nbytes + self.ids.nbytes + self.in_set.nbytes + self.slot_of.nbytes + self.last_hit.nbytes
        if self.t2r is not None:
            b += self.t2r.nbytes + self.eligible.nbytes
        return b
