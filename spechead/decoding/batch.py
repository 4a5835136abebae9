"""Batched speculative decoding with continuous batching: B requests in flight, one target forward a round.

Each request has its own cache lane (target and drafter), prompt length, sampling settings, stop
conditions, head state (a stateless head is shared; NanoSpec keeps one active set per request) and
draft tree. A round: the drafter catches every speculating request up on its accepted pairs in one
pass, drafts all their trees level by level (one drafter pass and one head call per level for all of
them, ``tree.draft_trees``), one target forward verifies every tree (``Transformer.forward_batch``:
the projections over all rows at once, attention per request under its own tree mask), and each
request accepts, compacts its lane and shows its head the verified tree on its own.

Requests join between rounds (``submit``; a newcomer is prefilled alone, exactly as ``Decoder`` does,
before the round it first speculates in) and leave when they finish or are cancelled (``cancel``), which
frees the lane for the next. Why the output is unchanged: a request's rows meet other requests' rows
only in the projections, and spechead's kernel computes each row in one fixed order whatever the row
count (``PackedLinear.pack`` lays the target out for the largest round); attention, acceptance and the
sampling draws are the request's own, so each request decodes exactly as ``Decoder`` would decode it
alone (bitwise for AR; for speculation, the acceptance rule is the same as at batch 1).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from spechead.decoding.decoder import GenerationResult, check_prompt, clip_round
from spechead.decoding.guard import Guard, GuardConfig
from spechead.decoding.sampling import Draws, SamplingConfig, accept, choose, make_draws
from spechead.decoding.tree import ContextLookup, DraftTree, TreeConfig, build_tree, draft_trees, place_lookup
from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead
from spechead.model.drafter import Drafter
from spechead.model.layers import Segment
from spechead.model.transformer import BatchPart, Transformer
from spechead.timing import Timers

ROW_BUDGET = 16  # verified rows a round aims at: the kernel's cheap range on the 2-core CPUs (batch_tree)


def batch_tree(tree: TreeConfig, batch: int, budget: int = ROW_BUDGET) -> TreeConfig | None:
    """The tree each request drafts in a round of ``batch`` requests (None: the round decodes autoregressively).

    Why it shrinks: on a CPU a verification row costs compute once a round holds more than a few rows in total
    (the demo target on 2 cores, AMD EPYC Zen 4: 8 rows cost 1.8x one row, 48 rows 4.2x), so the rows a round can
    spend on drafts that may be rejected fall as requests share it. Each request gets ``budget // batch`` rows:
    ``tree`` where it fits, else a one-token draft plus a lookup branch filling the share, none below two rows."""
    rows = budget // batch
    if rows >= tree.max_rows:
        return tree
    if rows < 2:
        return None
    return TreeConfig(1, 0, 2, lookup=min(rows - 2, tree.lookup), lookup_first=tree.lookup_first)


@dataclass
class BatchEvent:
    """What a round did for one request: the tokens it committed (possibly none) and, once it finished, its
    result."""

    rid: int
    tokens: list[int]
    result: GenerationResult | None = None


@dataclass
class _Request:
    rid: int
    ids: Tensor
    max_new: int
    draws: Draws | None  # None: greedy
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
    prefill_s: float = 0.0
    rounds: int = 0
    cancelled: bool = False


class BatchDecoder:
    """Up to ``max_batch`` requests decoded together; ``drafter`` None decodes them autoregressively.

    ``head``: builds a draft head (called once for a stateless head, which every request shares, and once per
    lane for a per-request one such as NanoSpec). ``tree``: every request's tree (or chain), or a rule giving the
    tree for the number of requests in a round (None: that round decodes autoregressively; the caches and the
    kernel's row reach are sized for the largest round the rule gives). ``guard``: never slower than batched AR
    (None: speculate in every round the rule allows). One ``Guard`` per number of requests in a round compares
    the tokens a speculative round commits for all of them per second with the AR rounds' at that occupancy,
    measured in place, and sends rounds to AR for a stretch where speculation loses: at batch 8 a round verifies
    16 rows for about 1.4 tokens a request, which on a CPU where 16 rows cost 1.8x a step (AMD EPYC Zen 4) lost
    to batched AR by a fifth. Its window and AR stretch are the configured ones divided by the requests in a round
    (at least 2): a round of eight carries eight requests' worth of evidence, and requests of a few dozen rounds
    left a guard with batch-1 windows speculating half of them. It chooses only how much to draft, so each
    request's output is unchanged."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None = None,
        head: Callable[[], DraftHead] | None = None,
        tree: TreeConfig | Callable[[int], TreeConfig | None] | None = None,
        max_batch: int = 8,
        stop_ids: list[int] | None = None,
        guard: GuardConfig | None = None,
    ) -> None:
        if max_batch < 1:
            raise SpecheadError(f"max_batch must be >= 1, got {max_batch}")
        if drafter is not None and head is None:
            raise ValueError("a drafter needs a head")
        if target.max_len == 0:
            raise RuntimeError("call setup_cache() on the target first")
        self.target, self.drafter, self.max_batch = target, drafter, max_batch
        fixed = tree if isinstance(tree, TreeConfig) else TreeConfig(2, 1, 4, 8)
        self.tree_for: Callable[[int], TreeConfig | None] = tree if callable(tree) else lambda n: fixed
        shapes = [(n, self.tree_for(n)) for n in range(1, max_batch + 1)]
        self.uses_lookup = any(t is not None and t.uses_lookup for _, t in shapes)
        self.max_len = target.max_len
        self.stop_ids = set(stop_ids or [])
        self.device = target.lm_head.weight.device
        self.timers = Timers()
        target.setup_cache(self.max_len, max_batch)
        rows = max((n * t.max_rows for n, t in shapes if t is not None), default=1) if drafter is not None else 1
        target.prepack(max(rows, max_batch))  # the kernel for every row of the largest round: rows as at B=1
        self._make_head, self._shared, self._lane_heads = head, None, {}
        if drafter is not None:
            slots = max([t.drafter_slots for _, t in shapes if t is not None] + [0])
            drafter.setup_cache(self.max_len + slots, max_batch)
            drafter.prepack(max_batch)
            first = head()
            self._shared = None if first.per_round else first
            if first.per_round:
                self._lane_heads[0] = first
        self.waiting: deque[_Request] = deque()
        self.active: list[_Request] = []
        self.last_round = 0  # requests the last step's round decoded (0: it ran none)
        self._next_rid = 0
        self.guard_cfg = guard if guard is not None and guard.enabled and drafter is not None else None
        self.guards: dict[int, Guard] = {}  # requests in a round -> its guard (no lean rung: the rule shrinks trees)

    # -- requests ---------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int] | Tensor,
        max_new_tokens: int = 128,
        sampling: SamplingConfig | None = None,
        head: DraftHead | None = None,
    ) -> int:
        """Queue a request; it joins at the next round with a free lane. Returns its id. ``head``: the request's
        own draft head (one object shared with other requests where it keeps no per-request state; a fresh one
        where it does), else the decoder's."""
        ids = check_prompt(prompt, self.max_len, self.target.config.vocab_size, self.device)
        if max_new_tokens < 1:
            raise SpecheadError("max_new_tokens must be >= 1")
        rid, self._next_rid = self._next_rid, self._next_rid + 1
        draws = make_draws(sampling or SamplingConfig())
        request = _Request(rid, ids, max_new_tokens, draws, time.perf_counter(), head=head)
        self.waiting.append(request)
        return rid

    def cancel(self, rid: int) -> None:
        """Drop a request at the next round, waiting or active (an active one's lane is then free); that round's
        events give its result, stop reason ``cancelled``, so a caller releases every request the same way."""
        for r in (*self.waiting, *self.active):
            if r.rid == rid:
                r.cancelled = True

    def accept_lengths_so_far(self, rid: int) -> list[int]:
        """A request still in the batch: its speculative rounds' accept lengths so far (what a caller that ends it
        early, on a stop string, reports as its tau); empty for one that has left."""
        return next((list(r.accept_lengths) for r in (*self.waiting, *self.active) if r.rid == rid), [])

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active)

    @property
    def occupancy(self) -> int:
        return len(self.active)

    # -- the loop ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[BatchEvent]:
        """One round: drop cancelled requests, admit waiting ones into free lanes, then draft and verify every
        active request's tree in one target forward."""
        events: list[BatchEvent] = []
        for r in [r for r in (*self.waiting, *self.active) if r.cancelled]:
            events.append(self._leave(r, "cancelled"))
        used = {r.lane for r in self.active}
        free = [lane for lane in range(self.max_batch) if lane not in used]
        while self.waiting and free:
            r = self.waiting.popleft()
            r.lane = free.pop(0)
            events += self._join(r)
        for r in [r for r in self.active if r.length >= self.max_len]:
            events.append(self._leave(r, "context"))
        self.last_round = len(self.active)
        if self.active:
            events += self._round(list(self.active))
        return events

    def generate(
        self, prompts: list[list[int] | Tensor], max_new_tokens: int = 128, sampling: SamplingConfig | None = None
    ) -> list[GenerationResult]:
        """Decode every prompt (up to ``max_batch`` at a time, newcomers joining as others finish); results in
        the prompts' order."""
        rids = [self.submit(p, max_new_tokens, sampling) for p in prompts]
        done: dict[int, GenerationResult] = {}
        while self.busy:
            done.update((e.rid, e.result) for e in self.step() if e.result is not None)
        return [done[rid] for rid in rids]

    # -- joining and leaving ----------------------------------------------------------------------
    def _head(self, lane: int) -> DraftHead:
        if self._shared is not None:
            return self._shared
        if lane not in self._lane_heads:
            self._lane_heads[lane] = self._make_head()
        return self._lane_heads[lane]

    def _join(self, r: _Request) -> list[BatchEvent]:
        """Prefill a newcomer alone on its lane (as ``Decoder`` does) and emit its first token."""
        t0, target, drafter = time.perf_counter(), self.target, self.drafter
        with self.timers("prefill", self.device):
            if drafter is None:
                pre = target.forward_batch([BatchPart(r.ids, 0, r.lane, logits_rows=slice(-1, None))])[0]
            else:
                r.head = r.head or self._head(r.lane)
                rows = slice(-r.head.prompt_logit_rows(r.ids.numel(), target.config), None)
                want_aux = drafter.arch == "eagle3"
                pre = target.forward_batch([BatchPart(r.ids, 0, r.lane, logits_rows=rows)], want_aux)[0]
                r.head.begin(r.ids, pre.logits if r.head.needs_prompt_logits else None)
            r.root = choose(pre.logits[-1], r.draws, r.ids.numel())
        r.prefill_s, r.length = time.perf_counter() - t0, r.ids.numel()
        if drafter is not None:
            r.feats, r.next_tokens = [drafter.target_features(pre)], r.ids[1:].tolist() + [r.root]
            if self.uses_lookup:
                r.lookup = ContextLookup()
                r.lookup.extend(r.ids.tolist() + [r.root])
        self.active.append(r)
        return [self._emit(r, [r.root])]

    def _emit(self, r: _Request, committed: list[int], spec: bool = False) -> BatchEvent:
        """Commit a round's tokens (clipped at a stop token or the budget); ``spec``: they came from a speculative
        round, whose accept length is what it really emitted."""
        new, reason = clip_round(committed, len(r.out), r.max_new, self.stop_ids)
        r.out += new
        if spec:
            r.accept_lengths.append(len(new))
        if r.lookup is not None:
            r.lookup.extend(new)
        if reason is not None:
            return self._leave(r, reason, new)
        return BatchEvent(r.rid, new)

    def _leave(self, r: _Request, reason: str, new: list[int] | None = None) -> BatchEvent:
        (self.active if r.lane >= 0 else self.waiting).remove(r)
        spec_rounds = len(r.accept_lengths)
        stats = r.head.stats() if r.head is not None else {}
        result = GenerationResult(
            r.out, r.ids.numel(), reason, r.accept_lengths, {}, time.perf_counter() - r.submitted, r.prefill_s,
            stats, {"speculative": spec_rounds, "ar": r.rounds - spec_rounds},
        )  # fmt: skip
        return BatchEvent(r.rid, new or [], result)

    # -- a round ----------------------------------------------------------------------------------
    def _trees(self, reqs: list[_Request], shape: TreeConfig) -> list[DraftTree]:
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
            h = drafter(torch.cat(tokens), torch.cat(feats), segments, torch.cat(positions), None)
            h_last = h[torch.tensor([s.row0 + s.t - 1 for s in segments], device=dev)]
        with tm("draft", dev):
            n_nodes = [min(shape.total_tokens - 1, self.max_len - r.length - 1) for r in reqs]
            trees = draft_trees(
                drafter, [r.head for r in reqs], h_last, [r.root for r in reqs], [r.length for r in reqs],
                [r.lane for r in reqs], shape, n_nodes,
            )  # fmt: skip
            for i, r in enumerate(reqs):
                if r.lookup is not None and shape.uses_lookup:
                    room = self.max_len - r.length
                    trees[i] = place_lookup(trees[i], r.lookup, shape, room)
        return trees

    def _guard(self, n: int) -> Guard:
        """The guard of rounds of ``n`` requests, made on first use: a round of n requests is n requests' worth of
        evidence, so its window and AR stretch are the configured ones over n (at least 2)."""
        if n not in self.guards:
            cfg = self.guard_cfg
            steps = max(2, -(-cfg.ar_steps // n))
            window = max(2, -(-cfg.window // n))
            self.guards[n] = Guard(
                replace(cfg, window=window, ar_steps=steps, max_ar_steps=max(steps, cfg.max_ar_steps))
            )
        return self.guards[n]

    def _round(self, reqs: list[_Request]) -> list[BatchEvent]:
        target, drafter, dev, tm = self.target, self.drafter, self.device, self.timers
        shape = self.tree_for(len(reqs)) if drafter is not None else None
        guard = self._guard(len(reqs)) if shape is not None and self.guard_cfg is not None else None
        if guard is not None and guard.ar:
            shape = None
        t0 = time.perf_counter()
        if shape is not None:
            trees = self._trees(reqs, shape)
        else:  # AR: one node per request (with a drafter, its pairs wait for the next speculative round)
            empty = torch.empty(0, dtype=torch.long, device=dev)
            trees = [build_tree(r.root, empty, empty, torch.empty(0, device=dev), 0) for r in reqs]
        want_aux = drafter is not None and drafter.arch == "eagle3"
        with tm("verify", dev):
            parts = []
            for r, tree in zip(reqs, trees, strict=True):
                if shape is None:  # exactly the batch-1 AR step
                    parts.append(BatchPart(tree.tokens, r.length, r.lane))
                    continue
                mask = torch.cat([torch.ones(tree.size, r.length, dtype=torch.bool, device=dev), tree.mask], dim=1)
                parts.append(BatchPart(tree.tokens, r.length, r.lane, tree.depth + r.length, mask))
            outs = target.forward_batch(parts, want_aux)
        events = []
        for r, tree, vo in zip(reqs, trees, outs, strict=True):
            with tm("accept", dev):
                path, committed = accept(tree.tokens.tolist(), tree.parents, vo.logits, r.draws, r.length + 1)
                if path[-1] != len(path) - 1:  # compact only when the path is not already contiguous
                    target.move_cache(torch.tensor(path, device=dev) + r.length, r.length, r.lane)
            r.rounds += 1
            if drafter is not None:  # an AR round too: the head sees a one-node tree, the drafter gets its pair
                with tm("observe", dev):
                    r.head.observe(tree.tokens, vo.logits, committed)
                f = drafter.target_features(vo)
                r.feats.append(f if shape is None else f[torch.tensor(path, device=dev)])
                r.next_tokens += committed
            r.length += len(committed)
            r.root = committed[-1]
            events.append(self._emit(r, committed, spec=shape is not None))
        if guard is not None:  # a speculative round: every token it committed; an AR one: the time per request
            seconds = time.perf_counter() - t0
            if shape is not None:
                guard.record(sum(len(e.tokens) for e in events), seconds)
            else:
                guard.record(1, seconds / len(reqs))
        return events
