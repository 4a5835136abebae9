"""The decoding engine: autoregressive baseline and EAGLE-style speculative decoding.

One request at a time (batch 1), everything preallocated. A round of speculative decoding is:
draft a tree from the drafter's state (drafter backbone + draft head), verify all of it with one
target forward under a tree attention mask, accept the longest path the target agrees with (or
the lossless sampling rule), compact the target KV cache to that path, show the head the verified
tree, and catch the drafter up on the accepted tokens, which also yields the next tree's root state.

A guard (``GuardConfig``) keeps speculation from being slower than plain decoding: when the measured
speculative rate falls below the AR step rate, the loop decodes autoregressively for a while (the same
target step as ``_autoregressive``, so the output is unchanged), then probes speculation again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from spechead.decoding.guard import Guard, GuardConfig
from spechead.decoding.sampling import SamplingConfig, accept, choose, make_draws
from spechead.decoding.tree import ContextLookup, TreeConfig, draft_tree, place_lookup
from spechead.errors import SpecheadError
from spechead.heads.base import DraftHead
from spechead.model.drafter import Drafter
from spechead.model.transformer import Transformer
from spechead.timing import Timers


@dataclass
class GenerationResult:
    tokens: list[int]
    prompt_len: int
    stop_reason: str  # "stop_token" | "max_new_tokens" | "context"
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification round
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


class Decoder:
    """Holds a target (and optionally a drafter + head) and generates for one prompt at a time."""

    def __init__(
        self,
        target: Transformer,
        drafter: Drafter | None = None,
        head: DraftHead | None = None,
        tree: TreeConfig | None = None,
        max_len: int = 4096,
        stop_ids: list[int] | None = None,
        guard: GuardConfig | None = None,
        ar_step_s: float | None = None,
    ) -> None:
        """``guard``: the never-slower-than-AR policy (None: none, plain speculation as measured by benchmarks
        of raw speculative speed; user-facing decoders pass GuardConfig()). ``ar_step_s``: a measured AR
        step time on this machine, which spares the guard measuring one (it still refines it from the AR
        steps it runs)."""
        self.target, self.drafter, self.head = target, drafter, head
        self.tree = tree or TreeConfig()
        self.lean_tree = self.tree.lean()
        self.guard = Guard(guard or GuardConfig(enabled=False), ar_step_s, has_lean=self.lean_tree != self.tree)
        self.max_len = min(max_len, target.config.max_position_embeddings)
        self.stop_ids = set(stop_ids or [])
        self.device = target.lm_head.weight.device
        self.timers = Timers()
        # the speculative rounds' accept lengths of the request being streamed so far: what a caller that stops
        # the stream early (a stop string) reports as its tau, the guard's AR steps not counted
        self.accept_lengths_so_far: list[int] = []
        target.setup_cache(self.max_len)
        if drafter is not None:
            if head is None:
                raise ValueError("a drafter needs a head")
            drafter.setup_cache(self.max_len + self.tree.drafter_slots)
        # decode steps run the target on one row, verification on up to `max_rows` rows every round: lay
        # its weights out for that (the same layout serves both where spechead's kernel runs, bitwise the same
        # per row whatever the row count; MKL's fallback packing serves `max_rows` only, so rounds whose lookup
        # branch is shorter use F.linear)
        target.prepack(self.tree.max_rows if drafter is not None else 1)
        if drafter is not None:
            drafter.prepack(self.tree.top_k)

    # -- helpers --------------------------------------------------------------------------------
    def _check_prompt(self, prompt: list[int] | Tensor) -> Tensor:
        return check_prompt(prompt, self.max_len, self.target.config.vocab_size, self.device)

    def _finish(self, new: list[int], out: list[int], max_new: int) -> tuple[list[int], str | None]:
        return clip_round(new, len(out), max_new, self.stop_ids)

    # -- public API -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int] | Tensor,
        max_new_tokens: int = 128,
        sampling: SamplingConfig | None = None,
        speculative: bool = True,
    ) -> GenerationResult:
        res = None
        for item in self.stream(prompt, max_new_tokens, sampling, speculative):
            if isinstance(item, GenerationResult):
                res = item
        assert res is not None
        return res

    @torch.inference_mode()
    def stream(
        self,
        prompt: list[int] | Tensor,
        max_new_tokens: int = 128,
        sampling: SamplingConfig | None = None,
        speculative: bool = True,
    ) -> Iterator[list[int] | GenerationResult]:
        """Yield lists of newly committed tokens as they are decided, then the GenerationResult."""
        if max_new_tokens < 1:
            raise SpecheadError("max_new_tokens must be >= 1")
        ids = self._check_prompt(prompt)
        cfg = sampling or SamplingConfig()
        if speculative and self.drafter is None:
            raise SpecheadError("speculative decoding needs a drafter")
        run = self._speculative if speculative else self._autoregressive
        self.accept_lengths_so_far = []
        yield from run(ids, max_new_tokens, cfg)

    def _autoregressive(self, ids: Tensor, max_new: int, cfg: SamplingConfig) -> Iterator[list[int] | GenerationResult]:
        tm, draws, t0 = Timers(), make_draws(cfg), time.perf_counter()
        with tm("prefill", self.device):
            logits = self.target(ids, 0, logits_rows=slice(-1, None)).logits[-1]
            tok = choose(logits, draws, ids.numel())
        prefill_s = time.perf_counter() - t0
        out: list[int] = []
        length = ids.numel()
        reason = None
        while True:
            new, reason = self._finish([tok], out, max_new)
            out += new
            if new:
                yield new
            if reason:
                break
            if length + 1 > self.max_len:
                reason = "context"
                break
            with tm("verify", self.device):
                logits = self.target(torch.tensor([tok], device=self.device), length).logits[-1]
                tok = choose(logits, draws, length + 1)
            length += 1
        steps = length - ids.numel()
        yield GenerationResult(
            out, ids.numel(), reason, [1] * (len(out) - 1), dict(tm.ms), time.perf_counter() - t0, prefill_s,
            mode_rounds={"speculative": 0, "ar": steps},
        )  # fmt: skip

    def _speculative(self, ids: Tensor, max_new: int, cfg: SamplingConfig) -> Iterator[list[int] | GenerationResult]:
        target, drafter, head, tree_cfg, guard = self.target, self.drafter, self.head, self.tree, self.guard
        tm, draws, t0, dev = Timers(), make_draws(cfg), time.perf_counter(), self.device
        head.timers.reset()
        guard.begin()
        want_aux = drafter.arch == "eagle3"
        with tm("prefill", dev):
            rows = slice(-head.prompt_logit_rows(ids.numel(), target.config), None)
            pre = target(ids, 0, logits_rows=rows, want_aux=want_aux)
            root = choose(pre.logits[-1], draws, ids.numel())
            head.begin(ids, pre.logits if head.needs_prompt_logits else None)
            lookup = ContextLookup() if tree_cfg.uses_lookup else None
            if lookup is not None:
                lookup.extend(ids.tolist() + [root])
        prefill_s = time.perf_counter() - t0
        length = ids.numel()  # tokens in the target cache; the root is not yet in it
        # the accepted pairs (feature_j, token_{j+1}) the drafter has not seen yet: the prompt's, then those
        # of every speculative round or AR step since its last catch-up
        feats, next_tokens = [drafter.target_features(pre)], ids[1:].tolist() + [root]
        out: list[int] = []
        accept_lengths = self.accept_lengths_so_far
        new, reason = self._finish([root], out, max_new)
        out += new
        yield new
        while reason is None:
            step_t0, ar = guard.clock(), guard.ar
            room = self.max_len - length
            if room <= 0:
                reason = "context"
                break
            if ar:  # exactly _autoregressive's step; the head sees it as a one-node tree
                with tm("ar", dev):
                    tree_tokens = torch.tensor([root], device=dev)
                    vo = target(tree_tokens, length, want_aux=want_aux)
                    committed, path_t = [choose(vo.logits[-1], draws, length + 1)], None
            else:
                # catch the drafter up on the accepted pairs; its cache then has `length` pairs
                with tm("backbone", dev):
                    f, feats = torch.cat(feats), []
                    pos = torch.arange(length - f.shape[0], length, device=dev)
                    h = drafter(torch.tensor(next_tokens, device=dev), f, length - f.shape[0], pos, None)  # causal
                    next_tokens = []
                shape = self.lean_tree if guard.lean else tree_cfg  # (the lean tree keeps tree_cfg's lookup)
                n_nodes = min(shape.total_tokens - 1, room - 1)
                with tm("draft", dev):
                    tree = draft_tree(drafter, head, h[-1:], root, length, shape, n_nodes)
                    if lookup is not None:
                        tree = place_lookup(tree, lookup, shape, room)
                with tm("verify", dev):
                    mask = torch.cat([torch.ones(tree.size, length, dtype=torch.bool, device=dev), tree.mask], dim=1)
                    vo = target(tree.tokens, length, positions=tree.depth + length, mask=mask, want_aux=want_aux)
                    path, committed = accept(tree.tokens.tolist(), tree.parents, vo.logits, draws, length + 1)
                    path_t = torch.tensor(path, device=dev)
                    if path[-1] != len(path) - 1:  # compact only when the path is not already contiguous
                        target.move_cache(path_t + length, length)
                tree_tokens = tree.tokens
            with tm("observe", dev):  # context-aware heads update here (NanoSpec's Ext source)
                head.observe(tree_tokens, vo.logits, committed)
            f = drafter.target_features(vo)
            feats.append(f if path_t is None else f[path_t])
            next_tokens += committed
            length += len(committed)
            root = committed[-1]
            new, reason = self._finish(committed, out, max_new)
            guard.record(len(committed), guard.clock() - step_t0)  # before the yield: the caller's time is not ours
            if not ar:
                accept_lengths.append(len(new))  # what the round really emitted (clipped at a stop or the budget)
            out += new
            if lookup is not None:
                lookup.extend(new)
            if new:
                yield new
        timers = dict(tm.ms)
        timers["head"] = head.timers.ms.get("head", 0.0)
        timers["gather"] = head.timers.ms.get("gather", 0.0)
        timers["backbone"] = timers.get("backbone", 0.0) + timers.get("draft", 0.0) - timers["head"] - timers["gather"]
        timers.pop("draft", None)
        yield GenerationResult(
            out,
            ids.numel(),
            reason,
            accept_lengths,
            timers,
            time.perf_counter() - t0,
            prefill_s,
            head.stats(),
            dict(guard.counts),
        )
