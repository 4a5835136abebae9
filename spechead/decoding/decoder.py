"""The decoding engine: one speculative round for 1..B requests, each on its own cache lane (batch 1 is one lane).

A round, for every request in it: catch the drafter up on the request's accepted pairs, draft a tree (drafter
backbone + draft head; one drafter pass and one head call per tree level for all requests), verify every tree in
one target forward (``Transformer.forward_batch``: the projections over all rows at once, attention per request
under its own tree mask), accept the longest path the target agrees with (or the lossless sampling rule), compact
the request's KV lane to that path and show its head the verified tree. Requests join between rounds (a newcomer
is prefilled alone) and leave when they finish or are cancelled, which frees the lane for the next.

Why the output is unchanged: a request's rows meet other requests' rows only in the projections, whose kernel
computes each row in one fixed order whatever the row count (``kernels.linear``); attention, acceptance and the
sampling draws (one per sequence position) are the request's own. So each request decodes exactly as plain AR
decoding of it alone would: greedy token for token, seeded sampling draw for draw.

The guard (``GuardConfig``) chooses per round how much to draft: the tree, a lean one-token draft, or nothing
(an AR step), so that speculation is never slower than AR; it never changes what is committed.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from spechead.decoding.guard import Guard, GuardConfig
from spechead.decoding.sampling import Draws, SamplingConfig, accept, choose, make_draws
from spechead.decoding.tree import ContextLookup, DraftTree, TreeConfig, draft_trees, place_lookup
from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead
from spechead.model.drafter import Drafter
from spechead.model.layers import Segment
from spechead.model.transformer import BatchPart, Transformer
from spechead.timing import Timers

TreeRule = Callable[[int], TreeConfig | None]  # requests in a round -> the tree each drafts (None: an AR round)


@dataclass
class GenerationResult:
    tokens: list[int]
    prompt_len: int
    stop_reason: str  # "stop_token" | "max_new_tokens" | "context" | "cancelled"
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per round (speculative, or plain AR)
    timers_ms: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    prefill_s: float = 0.0
    head_stats: dict[str, float] = field(default_factory=dict)
    mode_rounds: dict[str, int] = field(default_factory=dict)  # target forwards after prefill, per mode

    @property
    def tau(self) -> float:
        """Mean tokens committed per speculative round (bonus token included); the guard's AR steps are
        not rounds (see ``mode_rounds``)."""
        return tau_of(self.accept_lengths)


@dataclass
class Event:
    """What a step did for one request: the tokens it committed (possibly none) and, once it finished, its result."""

    rid: int
    tokens: list[int]
    result: GenerationResult | None = None


def tau_of(accept_lengths: list[int]) -> float:
    """Mean tokens committed per speculative round; 1.0 before any (a reply stopped early reports it too)."""
    return sum(accept_lengths) / len(accept_lengths) if accept_lengths else 1.0


def check_prompt(prompt: list[int] | Tensor, max_len: int, vocab_size: int, device: torch.device) -> Tensor:
    """A request's prompt as ids [T], or a user error: empty, too long for the context, ids outside the vocabulary."""
    ids = torch.as_tensor(prompt, dtype=torch.long, device=device).flatten()
    if ids.numel() == 0:
        raise SpecheadError("empty prompt")
    if ids.numel() >= max_len:
        raise SpecheadError(f"prompt of {ids.numel()} tokens does not fit the context of {max_len} tokens")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise SpecheadError("prompt contains token ids outside the vocabulary")
    return ids


def clip_round(new: list[int], done: int, max_new: int, stop_ids: set[int]) -> tuple[list[int], str | None]:
    """Clip a round's tokens at a stop token or the budget (``done`` tokens already emitted); returns (tokens to
    emit, stop reason or None)."""
    for i, t in enumerate(new):
        if done + i + 1 > max_new:
            return new[:i], "max_new_tokens"
        if t in stop_ids:
            return new[: i + 1], "stop_token"
        if done + i + 1 == max_new:
            return new[: i + 1], "max_new_tokens"
    return new, None


@dataclass(eq=False)
class Request:
    """A request's state between rounds."""

    rid: int
    ids: Tensor
    max_new: int
    draws: Draws | None  # None: greedy
    speculative: bool
    submitted: float
    lane: int = -1
    head: DraftHead | None = None
    lookup: ContextLookup | None = None
    length: int = 0  # tokens in the target cache; the root is not yet in it
    root: int = 0
    out: list[int] = field(default_factory=list)
    feats: list[Tensor] = field(default_factory=list)  # accepted pairs the drafter has not seen yet
    next_tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)
    modes: dict[str, int] = field(default_factory=lambda: {"speculative": 0, "lean": 0, "ar": 0})
    prefill_s: float = 0.0
    cancelled: bool = False
    timers0: dict[str, float] = field(default_factory=dict)  # the decoder's and head's timers when it joined
    head_timers0: dict[str, float] = field(default_factory=dict)


def _since(now: dict[str, float], then: dict[str, float]) -> dict[str, float]:
    return {k: v - then.get(k, 0.0) for k, v in now.items() if v - then.get(k, 0.0) > 0}


class Decoder:
    """Up to ``max_batch`` requests decoded together; ``drafter`` None decodes them autoregressively.

    ``head``: a draft head, or a function that builds one (called once for a stateless head, which every request
    shares, and once per lane for one that keeps per-request state, such as NanoSpec's). ``tree``: every request's
    tree, or a rule giving it for the number of requests in a round (None: that round decodes autoregressively).
    ``guard``: the never-slower-than-AR policy (None: speculate every round). One ``Guard`` per number of requests
    in a round compares the tokens a speculative round commits per second with the AR rounds' at that occupancy;
    a round of n requests is n requests' worth of evidence, so above one its window and AR stretch are the
    configured ones over n (at least 2). ``ar_step_s``: a measured batch-1 AR step time, which spares that guard
    measuring one."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None = None,
        head: DraftHead | Callable[[], DraftHead] | None = None,
        tree: TreeConfig | TreeRule | None = None,
        max_len: int = 4096,
        stop_ids: list[int] | None = None,
        guard: GuardConfig | None = None,
        ar_step_s: float | None = None,
        max_batch: int = 1,
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise SpecheadError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if drafter is not None and head is None:
            raise ValueError("a drafter needs a head")
        Guard.check_ar_step_s(ar_step_s)  # (checked whether or not a guard is built)
        self.target, self.drafter, self.max_batch = target, drafter, max_batch
        fixed = tree if isinstance(tree, TreeConfig) else TreeConfig()
        self.tree_for: TreeRule = tree if callable(tree) else (lambda n: fixed)
        self.tree = self.tree_for(1) or fixed  # the batch-1 tree
        self.lean_tree = self.tree.lean()
        shapes = [t for t in (self.tree_for(n) for n in range(1, max_batch + 1)) if t is not None]
        self.uses_lookup = any(t.uses_lookup for t in shapes)
        self.max_len = min(max_len, target.config.max_position_embeddings)
        self.stop_ids = set(stop_ids or [])
        self.device = target.model.norm.weight.device
        self.timers = Timers()
        target.setup_cache(self.max_len, max_batch)
        target.prepack()  # every row of every round on the kernel, bitwise as the row alone
        self._make_head: Callable[[], DraftHead] | None = None
        self._shared: DraftHead | None = None
        self._lane_heads: dict[int, DraftHead] = {}
        if drafter is not None:
            drafter.setup_cache(self.max_len + max((t.drafter_slots for t in shapes), default=0), max_batch)
            drafter.prepack(target.precision)
            first = head if isinstance(head, DraftHead) else head()
            if first.per_round and isinstance(head, DraftHead) and max_batch > 1:
                raise ValueError("a head that keeps per-request state needs a function that builds one per lane")
            self._make_head = None if isinstance(head, DraftHead) else head
            if first.per_round:
                self._lane_heads[0] = first
            else:
                self._shared = first
        self.guard_cfg = guard if guard is not None and guard.enabled and drafter is not None else None
        self.ar_step_s = ar_step_s
        self.guards: dict[int, Guard] = {}
        if self.guard_cfg is not None:
            self._guard(1)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.last_round = 0  # requests the last step's round decoded (0: it ran none)
        self._next_rid = 0
        # The models, caches and heads are long-lived: out of the cyclic collector's reach, whose full collections
        # (set off by each round's short-lived objects) otherwise walk all of them, ~4 % of the demo target's
        # decode step at gguf (sampled on an AMD EPYC Zen 4). They are still freed by reference count.
        gc.freeze()

    # -- what a batch-1 caller reads ----------------------------------------------------------------
    @property
    def head(self) -> DraftHead | None:
        """The head of lane 0 (every lane's, for a stateless head)."""
        return self._shared or self._lane_heads.get(0)

    @property
    def guard(self) -> Guard | None:
        """The guard of rounds of one request."""
        return self._guard(1)

    @guard.setter
    def guard(self, value: Guard) -> None:
        self.guards[1] = value

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    @property
    def occupancy(self) -> int:
        return len(self.active)

    # -- requests -----------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int] | Tensor,
        max_new_tokens: int = 128,
        sampling: SamplingConfig | None = None,
        speculative: bool | None = None,
        head: DraftHead | None = None,
    ) -> int:
        """Queue a request; it joins at the next step with a free lane. Returns its id. ``speculative``: draft for
        it (default: where the decoder has a drafter). ``head``: the request's own draft head (shared with other
        requests where it keeps no per-request state; a fresh one where it does), else the decoder's."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecheadError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        ids = check_prompt(prompt, self.max_len, self.target.config.vocab_size, self.device)
        if speculative and self.drafter is None:
            raise SpecheadError("speculative decoding needs a drafter")
        spec = self.drafter is not None if speculative is None else speculative
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        self.waiting.append(Request(rid, ids, max_new_tokens, make_draws(sampling or SamplingConfig()), spec,
                                    time.perf_counter(), head=head))  # fmt: skip
        return rid

    def cancel(self, rid: int) -> None:
        """Drop a request at the next step, waiting or active (an active one's lane is then free); that step's
        events give its result, stop reason ``cancelled``, so a caller releases every request the same way."""
        for r in (*self.waiting, *self.active):
            if r.rid == rid:
                r.cancelled = True

    def accept_lengths_so_far(self, rid: int) -> list[int]:
        """A request still in the decoder: its speculative rounds' accept lengths so far (what a caller that ends
        it early, on a stop string, reports as its tau); empty for one that has left."""
        return next((list(r.accept_lengths) for r in (*self.waiting, *self.active) if r.rid == rid), [])

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Drop cancelled requests, admit waiting ones into free lanes (prefilled alone), then run one round for
        every active request."""
        events: list[Event] = [self._leave(r, "cancelled") for r in (*self.waiting, *self.active) if r.cancelled]
        used = {r.lane for r in self.active}
        free = [lane for lane in range(self.max_batch) if lane not in used]
        while self.waiting and free:
            r = self.waiting.popleft()
            r.lane = free.pop(0)
            events.append(self._join(r))
        events += [self._leave(r, "context") for r in self.active if r.length >= self.max_len]
        self.last_round = len(self.active)
        if self.active:
            events += self._round(list(self.active))
        return events

    def stream(
        self,
        prompt: list[int] | Tensor,
        max_new_tokens: int = 128,
        sampling: SamplingConfig | None = None,
        speculative: bool | None = None,
    ) -> Iterator[list[int] | GenerationResult]:
        """One request alone: yield lists of newly committed tokens as they are decided, then its result. Closing
        the iterator early drops the request."""
        if self.busy:
            raise SpecheadError("stream() and generate() decode one request alone; this decoder has others in flight")
        rid = self.submit(prompt, max_new_tokens, sampling, speculative)
        try:
            while True:
                for e in self.step():
                    if e.tokens:
                        yield e.tokens
                    if e.result is not None:
                        yield e.result
                        return
        finally:
            if self.busy:
                self.cancel(rid)
                self.step()

    def generate(
        self,
        prompt: list[int] | Tensor,
        max_new_tokens: int = 128,
        sampling: SamplingConfig | None = None,
        speculative: bool | None = None,
    ) -> GenerationResult:
        """One request alone, to its end."""
        return [x for x in self.stream(prompt, max_new_tokens, sampling, speculative)][-1]  # type: ignore[return-value]

    def generate_batch(
        self, prompts: list[list[int] | Tensor], max_new_tokens: int = 128, sampling: SamplingConfig | None = None
    ) -> list[GenerationResult]:
        """Decode every prompt (up to ``max_batch`` at a time, newcomers joining as others finish); results in
        the prompts' order."""
        rids = [self.submit(p, max_new_tokens, sampling) for p in prompts]
        done: dict[int, GenerationResult] = {}
        while self.busy:
            done.update((e.rid, e.result) for e in self.step() if e.result is not None)
        return [done[rid] for rid in rids]

    # -- joining and leaving ------------------------------------------------------------------------
    def _lane_head(self, lane: int) -> DraftHead:
        if self._shared is not None:
            return self._shared
        if lane not in self._lane_heads:
            self._lane_heads[lane] = self._make_head()
        return self._lane_heads[lane]

    def _join(self, r: Request) -> Event:
        """Prefill a newcomer alone on its lane and emit its first token."""
        if not self.active and self.guards.get(1) is not None:
            self.guards[1].begin()  # a request alone: the batch-1 guard's per-request state starts afresh
        t0, target, drafter = time.perf_counter(), self.target, self.drafter
        r.timers0 = dict(self.timers.ms)
        with self.timers("prefill", self.device):
            if not r.speculative:
                pre = target.forward_batch([BatchPart(r.ids, 0, r.lane, logits_rows=slice(-1, None))])[0]
            else:
                r.head = r.head or self._lane_head(r.lane)
                r.head_timers0 = dict(r.head.timers.ms)
                rows = slice(-r.head.prompt_logit_rows(r.ids.numel(), target.config), None)
                want_aux = drafter.arch == "eagle3"
                pre = target.forward_batch([BatchPart(r.ids, 0, r.lane, logits_rows=rows)], want_aux)[0]
                r.head.begin(r.ids, pre.logits if r.head.needs_prompt_logits else None)
            r.root = choose(pre.logits[-1], r.draws, r.ids.numel())
            if r.speculative:
                r.feats, r.next_tokens = [drafter.target_features(pre)], r.ids[1:].tolist() + [r.root]
                if self.uses_lookup:
                    r.lookup = ContextLookup()
                    r.lookup.extend(r.ids.tolist() + [r.root])
        r.prefill_s, r.length = time.perf_counter() - t0, r.ids.numel()
        self.active.append(r)
        return self._emit(r, [r.root])

    def _emit(self, r: Request, committed: list[int], rounded: bool = False) -> Event:
        """Commit a round's tokens (clipped at a stop token or the budget); ``rounded``: a round whose accept
        length counts (a speculative round, or a plain AR step), which is what it really emitted."""
        new, reason = clip_round(committed, len(r.out), r.max_new, self.stop_ids)
        r.out += new
        if rounded:
            r.accept_lengths.append(len(new))
        if r.lookup is not None:
            r.lookup.extend(new)
        if reason is not None:
            return self._leave(r, reason, new)
        return Event(r.rid, new)

    def _leave(self, r: Request, reason: str, new: list[int] | None = None) -> Event:
        (self.active if r.lane >= 0 else self.waiting).remove(r)
        timers = _since(self.timers.ms, r.timers0) if r.lane >= 0 else {}
        stats, modes = {}, dict(r.modes)
        if r.speculative and r.head is not None:
            stats = r.head.stats()
            head_ms = _since(r.head.timers.ms, r.head_timers0)
            timers["head"], timers["gather"] = head_ms.get("head", 0.0), head_ms.get("gather", 0.0)
            timers["backbone"] = timers.get("backbone", 0.0) + timers.pop("draft", 0.0) - timers["head"]
            timers["backbone"] -= timers["gather"]
        else:
            modes = {"speculative": 0, "ar": modes["ar"]}
        result = GenerationResult(
            r.out, r.ids.numel(), reason, r.accept_lengths, timers, time.perf_counter() - r.submitted, r.prefill_s,
            stats, modes,
        )  # fmt: skip
        return Event(r.rid, new or [], result)

    # -- a round ------------------------------------------------------------------------------------
    def _guard(self, n: int) -> Guard | None:
        """The guard of rounds of ``n`` requests, made on first use (None: no guard)."""
        if n not in self.guards and self.guard_cfg is not None:
            cfg, shape = self.guard_cfg, self.tree_for(n)
            if n > 1:
                steps, window = max(2, -(-cfg.ar_steps // n)), max(2, -(-cfg.window // n))
                cfg = replace(cfg, window=window, ar_steps=steps, max_ar_steps=max(steps, cfg.max_ar_steps))
            lean = shape is not None and shape.lean() != shape
            self.guards[n] = Guard(cfg, self.ar_step_s if n == 1 else None, has_lean=lean)
        return self.guards.get(n)

    def _draft(self, reqs: list[Request], shape: TreeConfig) -> list[DraftTree]:
        """Catch the drafter up on every request's accepted pairs in one pass, then draft all their trees."""
        drafter, dev, tm = self.drafter, self.device, self.timers
        with tm("backbone", dev):
            segments, tokens, feats, positions, row0 = [], [], [], [], 0
            for r in reqs:
                f = torch.cat(r.feats)
                n = f.shape[0]
                segments.append(Segment(row0, n, r.length - n, None, r.lane))
                tokens.append(torch.tensor(r.next_tokens, device=dev))
                feats.append(f)
                positions.append(torch.arange(r.length - n, r.length, device=dev))
                r.feats, r.next_tokens, row0 = [], [], row0 + n
            one = len(reqs) == 1
            cat = (lambda xs: xs[0]) if one else torch.cat
            h = drafter(cat(tokens), cat(feats), segments, cat(positions), None)
            h_last = h[-1:] if one else h[torch.tensor([s.row0 + s.t - 1 for s in segments], device=dev)]
        with tm("draft", dev):
            n_nodes = [min(shape.total_tokens - 1, self.max_len - r.length - 1) for r in reqs]
            trees = draft_trees(
                drafter, [r.head for r in reqs], h_last, [r.root for r in reqs], [r.length for r in reqs],
                [r.lane for r in reqs], shape, n_nodes,
            )  # fmt: skip
            if shape.uses_lookup:
                for i, r in enumerate(reqs):
                    if r.lookup is not None:
                        trees[i] = place_lookup(trees[i], r.lookup, shape, self.max_len - r.length)
        return trees

    def _round(self, reqs: list[Request]) -> list[Event]:
        """Draft for the speculating requests, verify every request's rows in one target forward, accept."""
        target, drafter, dev, tm = self.target, self.drafter, self.device, self.timers
        speculating = any(r.speculative for r in reqs)
        shape = self.tree_for(len(reqs)) if speculating else None
        guard = self._guard(len(reqs)) if shape is not None else None
        mode = "speculative" if shape is not None else "plain"
        if guard is not None and guard.ar:
            shape, mode = None, "ar"
        elif guard is not None and guard.lean:
            shape, mode = shape.lean(), "lean"
        t0 = guard.clock() if guard is not None else 0.0
        spec = [r for r in reqs if r.speculative] if shape is not None else []
        trees = dict(zip((r.rid for r in spec), self._draft(spec, shape), strict=True)) if spec else {}
        want_aux = speculating and drafter.arch == "eagle3"
        committed_all: list[tuple[Request, list[int], bool]] = []
        paths: list[Tensor | None] = []
        with tm("ar" if mode == "ar" else "verify", dev):
            parts = []
            for r in reqs:
                tree = trees.get(r.rid)
                if tree is None:  # exactly a plain AR step
                    parts.append(BatchPart(torch.tensor([r.root], device=dev), r.length, r.lane))
                    continue
                mask = torch.cat([torch.ones(tree.size, r.length, dtype=torch.bool, device=dev), tree.mask], dim=1)
                parts.append(BatchPart(tree.tokens, r.length, r.lane, tree.depth + r.length, mask))
            outs = target.forward_batch(parts, want_aux)
            for r, vo in zip(reqs, outs, strict=True):
                tree, path_t = trees.get(r.rid), None
                if tree is None:
                    committed = [choose(vo.logits[-1], r.draws, r.length + 1)]
                else:
                    path, committed = accept(tree.tokens.tolist(), tree.parents, vo.logits, r.draws, r.length + 1)
                    path_t = torch.tensor(path, device=dev)
                    if path[-1] != len(path) - 1:  # compact only when the path is not already contiguous
                        target.move_cache(path_t + r.length, r.length, r.lane)
                committed_all.append((r, committed, tree is not None))
                paths.append(path_t)
        for (r, committed, _), part, vo, path_t in zip(committed_all, parts, outs, paths, strict=True):
            if r.speculative:  # an AR round too: the head sees a one-node tree, the drafter gets its pair
                with tm("observe", dev):
                    r.head.observe(part.tokens, vo.logits, committed)
                f = drafter.target_features(vo)
                r.feats.append(f if path_t is None else f[path_t])
                r.next_tokens += committed
        events = []
        for r, committed, drafted in committed_all:
            r.length += len(committed)
            r.root = committed[-1]
            self._count(r, mode if r.speculative else "plain")
            events.append(self._emit(r, committed, rounded=drafted or not r.speculative))
        if guard is not None:  # a speculative round: every token it committed; an AR one: the time per request
            seconds = guard.clock() - t0
            if mode == "ar":
                guard.record(1, seconds / len(reqs))
            else:
                guard.record(sum(len(c) for _, c, _ in committed_all), seconds)
        return events

    @staticmethod
    def _count(r: Request, mode: str) -> None:
        if mode == "plain":
            r.modes["ar"] += 1
            return
        r.modes["ar" if mode == "ar" else "speculative"] += 1
        if mode == "lean":
            r.modes["lean"] += 1
