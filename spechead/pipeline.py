"""Assemble a ready decoder from user-facing names (CLI, benchmark and server share this)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .drafter import Drafter, load_drafter, random_drafter
from .engine import Decoder
from .heads import make_head
from .loading import SpecheadError, encode_chat, load_target, load_tokenizer, stop_token_ids
from .model import Transformer
from .tree import TreeConfig

DEMO_DRAFTERS = Path(__file__).parent / "drafters"
# Chosen by measurement on the 2-core CPU with the shipped drafter (README, "Tree shape";
# results/bench/tree-sweep3): a shallow drafted tree (top_k 2, depth 1, 4 tokens) plus an 8-token
# context-lookup branch was fastest (NanoSpec 1.70x AR, tau 2.37) against 2x4x8 with the same branch
# (1.53x, tau 2.53) and 2x4x8 without it (1.20x, tau 1.83): the lookup branch supplies the long accepted
# runs for free, and every drafter pass (about 1 ms here) costs more than the tokens it adds. On a GPU,
# where drafter passes and verification rows are nearly free, the published 10/5/60 applies; pass --tree.
DEFAULT_TREE = TreeConfig(top_k=2, depth=1, total_tokens=4, lookup=8)


def demo_drafter_path(arch: str = "eagle2") -> Path | None:
    path = DEMO_DRAFTERS / arch
    return path if (path / "config.json").is_file() else None


def resolve_drafter(spec: str, target: Transformer, arch: str = "eagle2", seed: int = 0) -> Drafter:
    """``demo`` (shipped drafter, or a seeded random one while none ships), ``random`` or a folder."""
    if spec == "demo":
        path = demo_drafter_path(arch)
        return load_drafter(path, target) if path else random_drafter(target, arch, seed)
    if spec == "random":
        return random_drafter(target, arch, seed)
    if spec.startswith("random:"):
        return random_drafter(target, spec.split(":", 1)[1], seed)
    return load_drafter(spec, target)


@dataclass
class Session:
    """A loaded target with its tokenizer; makes decoders for any drafter/head combination."""

    target: Transformer
    folder: Path
    tokenizer: object
    max_len: int

    @classmethod
    def open(
        cls, target: str = "demo", max_len: int = 4096, dtype: torch.dtype = torch.float32, compile: bool = False
    ) -> Session:
        """Load a target. ``compile`` wraps its forward in torch.compile (dynamic shapes): on the CPU this
        removes most per-op overhead of a decode step, at the cost of a one-time compilation."""
        model, folder = load_target(target, dtype)
        max_len = min(max_len, model.config.max_position_embeddings)
        model.setup_cache(max_len)
        if compile:
            model.compile(dynamic=True)
        return cls(model, folder, load_tokenizer(folder), max_len)

    @property
    def stop_ids(self) -> list[int]:
        return stop_token_ids(self.tokenizer, self.target.config)

    def decoder(self, drafter: Drafter | None = None, head: str = "full", tree: TreeConfig | None = None) -> Decoder:
        draft_head = None
        if drafter is not None:
            weight, row_ids = drafter.head_weight(self.target)
            name, _, arg = head.partition(":")
            own = getattr(drafter, "low_rank_head", None)
            if own is not None and name in ("full", "lowrank"):
                # A drafter trained with a SlimSpec head is decoded with its own factors (lowrank:R re-truncates).
                from .lowrank import LowRankHead

                rank = int(arg) if arg.isdigit() else None
                draft_head = LowRankHead(own, row_ids, self.target.config.vocab_size, rank)
            else:
                draft_head = make_head(head, weight, row_ids, self.target.config.vocab_size)
        return Decoder(self.target, drafter, draft_head, tree or DEFAULT_TREE, self.max_len, self.stop_ids)

    def encode(self, turns: list[dict[str, str]] | str) -> list[int]:
        if isinstance(turns, str):
            if not turns.strip():
                raise SpecheadError("empty prompt")
            turns = [{"role": "user", "content": turns}]
        return encode_chat(self.tokenizer, turns)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
