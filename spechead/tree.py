"""EAGLE-2 dynamic draft trees: expansion with cumulative scores, global re-rank, tree buffers.

Nodes are numbered with the root (the last committed token, not yet verified) as 0. A tree is
valid when every node's parent precedes it; the global re-rank guarantees this because a child's
cumulative log-prob never exceeds its parent's and a stable sort breaks ties by candidate index,
and parents are always created before their children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .drafter import Drafter
from .heads import DraftHead


@dataclass(frozen=True)
class TreeConfig:
    """top_k children per expanded node (and nodes expanded per level), depth expansion steps
    (max draft length depth+1), total_tokens verified per round including the root."""

    top_k: int = 4
    depth: int = 4
    total_tokens: int = 16

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 0 or self.total_tokens < 1:
            raise ValueError(f"invalid tree {self}: need top_k >= 1, depth >= 0, total_tokens >= 1")

    @property
    def max_drafts(self) -> int:
        """Candidate pool size: k at the first level, k*k per expansion."""
        return self.top_k + self.depth * self.top_k**2

    @property
    def drafter_slots(self) -> int:
        """Drafter cache slots one round of expansion uses beyond the prefix."""
        return self.top_k * (self.depth + 1)

    @classmethod
    def chain(cls, length: int) -> TreeConfig:
        """Classic chain drafting: ``length`` tokens, one candidate each."""
        return cls(top_k=1, depth=length - 1, total_tokens=length + 1)

    @classmethod
    def parse(cls, spec: str) -> TreeConfig:
        """``K,D,T`` or ``KxDxT`` (top_k, depth, total tokens), or ``chain:N``."""
        try:
            if spec.startswith("chain:"):
                return cls.chain(int(spec.split(":", 1)[1]))
            k, d, t = (int(x) for x in spec.replace("x", ",").split(","))
            return cls(k, d, t)
        except ValueError as e:
            raise ValueError(f"invalid tree spec {spec!r} (want 'K,D,T', 'KxDxT' or 'chain:N'): {e}") from e


@dataclass
class DraftTree:
    tokens: Tensor  # [N] root first
    parents: list[int]  # parent node of each node (-1 for the root)
    mask: Tensor  # bool [N, N]: node sees itself and its ancestors
    depth: Tensor  # [N] root = 0

    @property
    def size(self) -> int:
        return self.tokens.numel()


def build_tree(root: int, cand_tokens: Tensor, cand_parents: Tensor, cand_scores: Tensor, n: int) -> DraftTree:
    """Keep the ``n`` best candidates (cumulative score, ties by candidate order) as a tree under root.

    cand_parents holds each candidate's parent as a candidate index, -1 for a child of the root.
    """
    device = cand_tokens.device
    n = min(n, cand_tokens.numel())
    order = torch.sort(cand_scores, descending=True, stable=True).indices[:n]
    keep = order.sort().values
    par_cand = cand_parents[keep]
    # candidate index -> tree node (position in `keep` + 1); the root is node 0
    pos = torch.searchsorted(keep, par_cand.clamp_min(0))
    if n and not bool(((par_cand < 0) | (keep[pos.clamp_max(n - 1)] == par_cand)).all()):
        raise AssertionError("tree selection kept a node without its parent")
    parents = torch.where(par_cand < 0, torch.zeros_like(pos), pos + 1)
    parent_of = torch.cat([torch.zeros(1, dtype=torch.long, device=device), parents])
    tokens = torch.cat([torch.tensor([root], device=device), cand_tokens[keep]])
    size = n + 1
    mask = torch.zeros(size, size, dtype=torch.bool, device=device)
    rows = torch.arange(size, device=device)
    anc = rows.clone()
    for _ in range(size):  # walk up; stops once every node has reached the root
        mask[rows, anc] = True
        if not bool(anc.any()):
            break
        anc = parent_of[anc]
    depth = mask.sum(-1) - 1
    par_list = [-1] + parents.tolist()
    return DraftTree(tokens, par_list, mask, depth)


def draft_tree(
    drafter: Drafter, head: DraftHead, h_last: Tensor, root: int, prefix: int, cfg: TreeConfig, n_nodes: int
) -> DraftTree:
    """EAGLE-2 expansion from the drafter's last state ``h_last`` [1, d].

    ``prefix`` is the number of accepted pairs in the drafter cache; tree levels are written after
    it and discarded when the next round overwrites them.
    """
    k, device = cfg.top_k, h_last.device
    if n_nodes <= 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return build_tree(root, empty, empty, torch.empty(0, device=device), 0)
    logp, ids = head.topk(drafter.head_input(h_last), k)
    n0 = ids.shape[-1]
    scores, tokens, parents = [logp[0]], [ids[0]], [torch.full((n0,), -1, dtype=torch.long, device=device)]
    cur_scores, cur_tokens, cur_h = logp[0], ids[0], h_last.expand(n0, -1)
    cur_index = torch.arange(n0, device=device)  # candidate indices of the nodes being expanded
    vis = torch.eye(n0, dtype=torch.bool, device=device)  # what each node sees among tree slots
    base, slot = n0, prefix
    for i in range(cfg.depth):
        width = cur_tokens.numel()
        mask = torch.cat([torch.ones(width, prefix, dtype=torch.bool, device=device), vis], dim=1)
        positions = torch.full((width,), prefix + i, dtype=torch.long, device=device)
        h = drafter(cur_tokens, cur_h, slot, positions, mask)
        slot += width
        logp, ids = head.topk(drafter.head_input(h), k)
        kc = ids.shape[-1]
        cu = (logp + cur_scores[:, None]).flatten()
        scores.append(cu)
        tokens.append(ids.flatten())
        parents.append(cur_index.repeat_interleave(kc))
        best = torch.sort(cu, descending=True, stable=True).indices[: min(k, cu.numel())]
        src = best // kc
        cur_scores, cur_tokens, cur_h = cu[best], ids.flatten()[best], h[src]
        cur_index = base + best
        base += cu.numel()
        vis = torch.cat([vis[src], torch.eye(best.numel(), dtype=torch.bool, device=device)], dim=1)
    return build_tree(root, torch.cat(tokens), torch.cat(parents), torch.cat(scores), n_nodes)
