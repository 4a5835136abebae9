"""Assemble a ready decoder from user-facing names (CLI, benchmark and server share this)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from spechead.decoding.decoder import Decoder
from spechead.decoding.guard import GuardConfig
from spechead.decoding.tree import TreeConfig, batch_tree
from spechead.errors import SpecheadError, say_once
from spechead.heads.base import DraftHead, head_class, make_head
from spechead.model.config import ModelConfig
from spechead.model.drafter import Drafter, load_drafter, random_drafter
from spechead.model.loading import load_target
from spechead.model.tokenizer import encode_text, encode_turns, load_tokenizer, stop_token_ids
from spechead.model.transformer import Transformer

DEMO_DRAFTERS = Path(__file__).parent.parent / "drafters"
# The tree where tuning cannot run: a shallow drafted tree (top_k 2, depth 1, 4 tokens) plus an 8-token
# context-lookup branch. On a 2-core CPU every drafter pass costs more than the tokens a deeper tree adds, and the
# lookup branch supplies long accepted runs for free (docs/trees.md). On a GPU, where drafter passes and
# verification rows are nearly free, deeper and wider trees pay; pass --tree.
DEFAULT_TREE = TreeConfig(top_k=2, depth=1, total_tokens=4, lookup=8)
# The CLI's default tree: what `spechead tune` measured fastest here (spechead/tuning/); DEFAULT_TREE is its
# fallback where tuning cannot run, and what a decoder gets without a tree. This layer only names it: a
# session's ``tree_resolver`` (the tuner's, attached by ``spechead.tuning.tune.open_session``) says what it is.
AUTO_TREE = "auto"
GUARD = GuardConfig()  # what the CLI, the server and the benchmark decode with: never slower than AR


class ResolvedTree(Protocol):
    """What a tree resolver returns for ``auto`` (``tuning.result.TuneResult`` is one)."""

    tree: TreeConfig
    ar_step_s: float | None  # the measured AR step time the guard starts from (None: it measures its own)

    def head_spec(self, head: str) -> str:
        """The head spec to decode with (the tuning may add an option, e.g. NanoSpec's gather mode)."""
        ...


# (session, drafter, head spec) -> what ``auto`` means for them; injected so this layer never knows the tuner
TreeResolver = Callable[["Session", Drafter, str], ResolvedTree]


def shipped_drafter_path(arch: str = "eagle2", target: ModelConfig | None = None) -> Path | None:
    """The drafter ``arch`` shipped for ``target``: ``drafters/<arch>`` is the demo target's, ``drafters/<model>/
    <arch>`` another target's, found by its config's vocabulary and hidden sizes (None: the demo's)."""
    for path in [DEMO_DRAFTERS / arch, *sorted(DEMO_DRAFTERS.glob(f"*/{arch}"))]:
        if not (path / "config.json").is_file():
            continue
        if target is None:
            return path
        cfg = json.loads((path / "config.json").read_text())
        width = cfg.get("target_hidden_size", cfg.get("hidden_size"))
        if cfg.get("vocab_size") == target.vocab_size and width == target.hidden_size:
            return path
    return None


def check_drafter_spec(spec: str) -> str:
    """Refuse a drafter folder that does not exist before anything is loaded (``demo`` and ``random[:ARCH]`` are
    names, not folders)."""
    if spec not in ("demo", "random") and not spec.startswith("random:") and not Path(spec).is_dir():
        raise SpecheadError(f"drafter not found: {spec}")
    return spec


def resolve_drafter(spec: str, target: Transformer, arch: str = "eagle2", seed: int = 0) -> Drafter:
    """``demo`` (the drafter shipped for this target, or a seeded random one where none ships), ``random`` or a
    folder."""
    if spec == "demo":
        path = shipped_drafter_path(arch, target.config)
        spec = str(path) if path else "random"
    if spec == "random" or spec.startswith("random:"):
        arch = spec.split(":", 1)[1] if ":" in spec else arch
        drafter, source = random_drafter(target, arch, seed), f"random:{arch}:seed={seed}"
    else:
        drafter, source = load_drafter(spec, target), str(Path(spec).resolve())
    drafter.spechead_source = source  # what the tuning cache knows the drafter by (tune.drafter_identity)
    return drafter


@dataclass
class Session:
    """A loaded target with its tokenizer; makes decoders for any drafter/head combination."""

    target: Transformer
    folder: Path
    tokenizer: object
    max_len: int
    tree_resolver: TreeResolver | None = None  # what ``tree="auto"`` means; None: DEFAULT_TREE (said once)
    source: str | None = None  # the target spec it was opened from (``demo``, a path): where its GGUF is

    @classmethod
    def open(
        cls,
        target: str = "demo",
        max_len: int = 4096,
        dtype: str | torch.dtype = "auto",
        compile: bool = False,
        tree_resolver: TreeResolver | None = None,
    ) -> Session:
        """Load a target. ``compile`` wraps its forward in torch.compile (dynamic shapes): on the CPU this
        removes most per-op overhead of a decode step, at the cost of a one-time compilation. User-facing
        entry points open through ``spechead.tuning.tune.open_session``, which passes the tuner as resolver."""
        model, folder = load_target(target, dtype)
        max_len = min(max_len, model.config.max_position_embeddings)
        model.setup_cache(max_len)
        if compile:
            model.compile(dynamic=True)
        return cls(model, folder, load_tokenizer(folder), max_len, tree_resolver, target)

    @property
    def float_folder(self) -> Path:
        """The target as a Hugging Face folder of float weights (for transformers and vLLM): the session's own folder,
        or, for a target on the integer engine, its float conversion."""
        if self.target.precision in ("gguf", "q8", "q4"):
            from spechead.model.loading import resolve_target

            return resolve_target(self.source or str(self.folder))
        return self.folder

    @property
    def stop_ids(self) -> list[int]:
        return stop_token_ids(self.tokenizer, self.target.config)

    def draft_head(self, drafter: Drafter, head: str = "full") -> DraftHead:
        """The head ``head`` (a spec such as ``nanospec:1024``) over ``drafter``'s LM head."""
        weight, row_ids = drafter.head_weight(self.target)
        if getattr(drafter, "side_low_rank", False) and not head_class(head).takes_side_factors:
            factors = None  # a fitted head beside the full one: `full`, `nanospec`, ... read the full head
        else:
            factors = getattr(drafter, "low_rank_head", None)  # a drafter trained or fitted with a SlimSpec head
        return make_head(head, weight, row_ids, self.target.config.vocab_size, factors)

    def decoder(
        self,
        drafter: Drafter | None = None,
        head: str = "full",
        tree: TreeConfig | str | None = None,
        guard: GuardConfig | None = GUARD,
        max_batch: int = 1,
    ) -> Decoder:
        """A decoder over this session's target for up to ``max_batch`` requests at a time, each with its own head
        where the head keeps per-request state.

        ``tree``: a TreeConfig or spec (every round's tree), None for DEFAULT_TREE, or ``auto``: what
        ``tree_resolver`` says (the tuner's: the tuned tree for this machine, target, drafter, head and thread
        count, cached, else measured now; DEFAULT_TREE if tuning cannot run), with its head spec (the tuned
        NanoSpec gather mode) and the measured AR step time for the guard; without a resolver, DEFAULT_TREE. With
        ``auto``, a round of several requests drafts ``batch_tree`` of that tree for its occupancy.
        ``guard``: the never-slower-than-AR policy user-facing decoders run with (None: speculate every round)."""
        ar_step_s, auto = None, isinstance(tree, str) and tree.strip() == AUTO_TREE
        if isinstance(tree, str):
            if not auto:
                tree = TreeConfig.parse(tree.strip())
            elif drafter is None:  # plain AR decoding has no tree to tune
                tree = None
            elif self.tree_resolver is None:
                say_once(
                    f"spechead: --tree auto: no tuner attached to this session; using the default tree {DEFAULT_TREE}"
                )
                tree = None
            else:
                tuned = self.tree_resolver(self, drafter, head)
                tree, head, ar_step_s = tuned.tree, tuned.head_spec(head), tuned.ar_step_s
        tree = tree or DEFAULT_TREE
        rule = (lambda n, t=tree: t if n == 1 else batch_tree(t, n)) if auto and max_batch > 1 else tree
        make = None
        if drafter is not None:
            make = lambda: self.draft_head(drafter, head)  # noqa: E731
        return Decoder(self.target, drafter, make, rule, self.max_len, self.stop_ids, guard, ar_step_s, max_batch)

    def encode(self, turns: list[dict[str, str]] | str, raw: bool = False) -> list[int]:
        """A prompt's ids: a string is one user turn; the chat template where the target has one (a base
        model's turns are written in the completion format); ``raw``: the string as plain text."""
        if isinstance(turns, str):
            if not turns.strip():
                raise SpecheadError("empty prompt")
            if raw:
                return encode_text(self.tokenizer, turns)
            turns = [{"role": "user", "content": turns}]
        return encode_turns(self.tokenizer, turns)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
