"""EAGLE-2 dynamic draft trees: expansion with cumulative scores, global re-rank, tree buffers.

Nodes are numbered with the root (the last committed token, not yet verified) as 0. A tree is
valid when every node's parent precedes it; the global re-rank guarantees this because a child's
cumulative log-prob never exceeds its parent's and a stable sort breaks ties by candidate index,
and parents are always created before their children.

Optionally a context lookup (prompt-lookup decoding) grafts one more branch onto each tree: the
tokens that followed the latest earlier occurrence of the context's last n-gram. It costs no drafter
work, only verification rows, and pays where the output copies its context (extraction, editing,
retrieval); verification decides every token as before, so it changes nothing in the output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from spechead.heads.base import DraftHead
from spechead.model.drafter import Drafter
from spechead.model.layers import Segment

MAX_ROWS = 1024  # tokens one verification may hold: far past where a tree stops paying on any device


@dataclass(frozen=True)
class TreeConfig:
    """top_k children per expanded node (and nodes expanded per level), depth expansion steps
    (max draft length depth+1), total_tokens verified per round including the root, and lookup:
    up to that many context-lookup tokens grafted on top (0: none). ``lookup_first``: a chain whose tokens come
    from the context lookup where it matches and from the drafter where it does not, in the same rows: how an
    engine that verifies one chain (vLLM) uses the lookup; grafting it as its own branch accepts at least as much
    where rows are cheap."""

    top_k: int = 4
    depth: int = 4
    total_tokens: int = 16
    lookup: int = 0
    lookup_first: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 0 or self.total_tokens < 1 or self.lookup < 0:
            raise ValueError(f"invalid tree {self}: need top_k >= 1, depth >= 0, total_tokens >= 1, lookup >= 0")
        if self.lookup_first and (self.top_k != 1 or self.lookup):
            raise ValueError(f"invalid tree {self}: +lookup-first replaces a chain's tokens (chain:N, no +lookup:L)")
        if self.max_rows > MAX_ROWS or self.depth >= MAX_ROWS:  # (chain:100000 drafted for minutes)
            raise ValueError(f"invalid tree {self}: a round verifies at most {MAX_ROWS} tokens, lookup included")

    @property
    def max_rows(self) -> int:
        """The most tokens one verification can hold: the drafted tree plus a lookup branch."""
        return self.total_tokens + self.lookup

    @property
    def uses_lookup(self) -> bool:
        """Whether a round consults the context lookup (a grafted branch or the chain's own tokens)."""
        return bool(self.lookup) or self.lookup_first

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
        if length < 1:
            raise ValueError(f"a chain drafts at least 1 token, got chain:{length}")
        return cls(top_k=1, depth=length - 1, total_tokens=length + 1)

    def lean(self) -> TreeConfig:
        """The guard's rung below this tree: one draft token (one head call a round), the same lookup branch."""
        return self if self.total_tokens <= 2 else replace(self, top_k=1, depth=0, total_tokens=2)

    @classmethod
    def parse(cls, spec: str) -> TreeConfig:
        """``K,D,T`` or ``KxDxT`` (top_k, depth, total tokens), or ``chain:N``; ``+lookup:L`` adds a
        context-lookup branch of up to L tokens; ``chain:N+lookup-first`` takes a chain's tokens from the lookup
        where it matches."""
        try:
            shape, plus, extra = spec.partition("+")
            lookup, first = 0, False
            if extra == "lookup-first":
                first = True
            elif plus:
                key, _, n = extra.partition(":")
                if key != "lookup":
                    raise ValueError(f"unknown tree option {extra!r}")
                lookup = int(n)
            if shape.startswith("chain:"):
                base = cls.chain(int(shape.split(":", 1)[1]))
            else:
                k, d, t = (int(x) for x in shape.replace("x", ",").split(","))
                base = cls(k, d, t)
            return replace(base, lookup=lookup, lookup_first=first)
        except ValueError as e:
            raise ValueError(
                f"invalid tree spec {spec!r} (want 'K,D,T', 'KxDxT' or 'chain:N', optionally '+lookup:L', or "
                f"'chain:N+lookup-first'): {e}"
            ) from e

    def __str__(self) -> str:
        shape = f"{self.top_k}x{self.depth}x{self.total_tokens}"
        return shape + (f"+lookup:{self.lookup}" if self.lookup else "+lookup-first" if self.lookup_first else "")


ROW_BUDGET = 16  # verified rows a batched round aims at: the few-row kernel's cheap range on a 2-core CPU


def batch_tree(tree: TreeConfig, batch: int, budget: int = ROW_BUDGET) -> TreeConfig | None:
    """The tree each request drafts in a round of ``batch`` requests (None: the round decodes autoregressively).

    On a CPU a verification row costs compute once a round holds more than a few rows in total, so the rows a
    round can spend on drafts that may be rejected fall as requests share it. Each request gets ``budget // batch``
    rows: ``tree`` where it fits, else a one-token draft plus a lookup branch filling the share, none below two."""
    rows = budget // batch
    if rows >= tree.max_rows:
        return tree
    if rows < 2:
        return None
    return TreeConfig(1, 0, 2, lookup=min(rows - 2, tree.lookup), lookup_first=tree.lookup_first)


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

    cand_parents holds each candidate's parent as a candidate index, -1 for a child of the root. A round's
    candidates are a few dozen, so the selection and the structure (parents, ancestors, depths) are worked out on
    the host and the tree's tensors made once each: ~40 us a tree where a tensor op a step cost ~200 us.
    """
    device = cand_tokens.device
    scores = cand_scores.tolist()
    best = sorted(range(len(scores)), key=lambda c: -scores[c])[: max(n, 0)]  # stable: ties keep candidate order
    keep = sorted(best)
    node_of = {c: i + 1 for i, c in enumerate(keep)}  # candidate index -> tree node; the root is node 0
    cand_par, cand_tok = (cand_parents.tolist(), cand_tokens.tolist()) if keep else ([], [])
    parents = [-1]
    for c in keep:
        p = cand_par[c]
        if p >= 0 and p not in node_of:
            raise AssertionError("tree selection kept a node without its parent")
        parents.append(0 if p < 0 else node_of[p])
    ancestors: list[set[int]] = [{0}]
    for node in range(1, len(parents)):  # a parent precedes its children
        ancestors.append(ancestors[parents[node]] | {node})
    size = len(parents)
    mask = torch.tensor([[j in anc for j in range(size)] for anc in ancestors], dtype=torch.bool, device=device)
    depth = torch.tensor([len(anc) - 1 for anc in ancestors], dtype=torch.long, device=device)
    tokens = torch.tensor([root] + [cand_tok[c] for c in keep], dtype=cand_tokens.dtype, device=device)
    return DraftTree(tokens, parents, mask, depth)


def draft_tree(
    drafter: Drafter, head: DraftHead, h_last: Tensor, root: int, prefix: int, cfg: TreeConfig, n_nodes: int
) -> DraftTree:
    """EAGLE-2 expansion from the drafter's last state ``h_last`` [1, d].

    ``prefix`` is the number of accepted pairs in the drafter cache; tree levels are written after
    it and discarded when the next round overwrites them.
    """
    return draft_trees(drafter, [head], h_last, [root], [prefix], [0], cfg, [n_nodes])[0]


def heads_topk(heads: list[DraftHead], h: Tensor, counts: list[int], k: int) -> list[tuple[Tensor, Tensor]]:
    """Top-k of the draft distribution for several requests' rows (``counts`` rows each, packed in ``h``): one
    call over the rows of every request that shares a head (a stateless head is one object for all), one per
    request that has its own (NanoSpec's per-request active set). Per request: (log-probs [rows, k'], ids)."""
    if all(x is heads[0] for x in heads):
        logp, ids = heads[0].topk(h, k)
        return list(zip(logp.split(counts), ids.split(counts), strict=True)) if len(counts) > 1 else [(logp, ids)]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    groups: dict[int, list[int]] = {}
    for i, head in enumerate(heads):
        groups.setdefault(id(head), []).append(i)
    out: list[tuple[Tensor, Tensor]] = [None] * len(heads)  # type: ignore[list-item]
    for members in groups.values():
        rows = torch.cat([torch.arange(starts[i], starts[i + 1], device=h.device) for i in members])
        logp, ids = heads[members[0]].topk(h[rows], k)
        for i, lp, ix in zip(
            members, logp.split([counts[i] for i in members]), ids.split([counts[i] for i in members]), strict=True
        ):
            out[i] = (lp, ix)
    return out


@dataclass
class _Expansion:
    """One request's EAGLE-2 expansion in progress: every candidate so far and the frontier being expanded."""

    scores: list[Tensor]
    tokens: list[Tensor]
    parents: list[Tensor]
    cur_scores: Tensor
    cur_tokens: Tensor
    cur_h: Tensor  # drafter states the frontier was drafted from
    cur_index: Tensor  # candidate indices of the frontier
    vis: Tensor  # what each frontier node sees among the tree's drafter slots
    base: int  # candidates so far
    slot: int  # next drafter slot


def draft_trees(
    drafter: Drafter,
    heads: list[DraftHead],
    h_last: Tensor,
    roots: list[int],
    prefixes: list[int],
    lanes: list[int],
    cfg: TreeConfig,
    n_nodes: list[int],
) -> list[DraftTree]:
    """EAGLE-2 expansion for several requests at once, from their drafter states ``h_last`` [B, d]: one
    drafter pass and one head call per level for all of them (``heads_topk``; ``heads``: each request's head,
    one for all of them, or the same object repeated), each request on its own drafter cache lane (``prefixes``:
    its accepted pairs; levels are written after them and overwritten next round)."""
    k, device = cfg.top_k, h_last.device
    live = [b for b, n in enumerate(n_nodes) if n > 0]
    empty = torch.empty(0, dtype=torch.long, device=device)
    trees = [build_tree(r, empty, empty, torch.empty(0, device=device), 0) if n <= 0 else None
             for r, n in zip(roots, n_nodes, strict=True)]  # fmt: skip
    if not live:
        return trees
    heads = [heads[0] if len(heads) == 1 else heads[b] for b in live]
    first = heads_topk(heads, drafter.head_input(h_last[live]), [1] * len(live), k)
    exps = []
    for b, (logp, ids) in zip(live, first, strict=True):
        n0 = ids.shape[-1]
        root_children = torch.full((n0,), -1, dtype=torch.long, device=device)
        eye = torch.eye(n0, dtype=torch.bool, device=device)
        frontier = (logp[0], ids[0], h_last[b].expand(n0, -1), torch.arange(n0, device=device), eye)
        exps.append(_Expansion([logp[0]], [ids[0]], [root_children], *frontier, n0, prefixes[b]))
    for i in range(cfg.depth):
        segments, row0 = [], 0
        for b, e in zip(live, exps, strict=True):
            width = e.cur_tokens.numel()
            mask = torch.cat([torch.ones(width, prefixes[b], dtype=torch.bool, device=device), e.vis], dim=1)
            segments.append(Segment(row0, width, e.slot, mask, lanes[b]))
            row0 += width
        depth_pos = [torch.full((g.t,), prefixes[b] + i, device=device) for b, g in zip(live, segments, strict=True)]
        cat = (lambda xs: xs[0]) if len(exps) == 1 else torch.cat
        tokens, states = cat([e.cur_tokens for e in exps]), cat([e.cur_h for e in exps])
        h = drafter(tokens, states, segments, cat(depth_pos), None)
        level = heads_topk(heads, drafter.head_input(h), [g.t for g in segments], k)
        for e, g, (logp, ids) in zip(exps, segments, level, strict=True):
            e.slot += g.t
            kc = ids.shape[-1]
            cu = (logp + e.cur_scores[:, None]).flatten()
            e.scores.append(cu)
            e.tokens.append(ids.flatten())
            e.parents.append(e.cur_index.repeat_interleave(kc))
            best = torch.sort(cu, descending=True, stable=True).indices[: min(k, cu.numel())]
            src = best // kc
            e.cur_scores, e.cur_tokens, e.cur_h = cu[best], ids.flatten()[best], h[g.row0 : g.row0 + g.t][src]
            e.cur_index = e.base + best
            e.base += cu.numel()
            e.vis = torch.cat([e.vis[src], torch.eye(best.numel(), dtype=torch.bool, device=device)], dim=1)
    for b, e in zip(live, exps, strict=True):
        trees[b] = build_tree(roots[b], torch.cat(e.tokens), torch.cat(e.parents), torch.cat(e.scores), n_nodes[b])
    return trees


class ContextLookup:
    """Prompt-lookup drafting over the request's context (prompt and output so far).

    ``propose`` returns the tokens that followed the latest earlier occurrence of the context's last
    n-gram, trying n = max_ngram down to min_ngram. A continuation that runs into the end of the
    context goes on copying its own output (an overlapping copy, as in LZ77), so a repeating run
    proposes more periods of itself instead of the one or two tokens left before the end. The index
    maps each n-gram to the position after its latest occurrence that already has a successor, so a
    lookup is one dict probe per n and ``extend`` costs O(max_ngram) per token.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ids: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.ids.append(t)
            nxt = len(self.ids) - 1  # t is the successor of the n-grams ending just before it
            for n in range(self.min_ngram, min(self.max_ngram, nxt) + 1):
                self.after[tuple(self.ids[nxt - n : nxt])] = nxt

    def propose(self, count: int) -> list[int]:
        if count <= 0:
            return []
        for n in range(min(self.max_ngram, len(self.ids)), self.min_ngram - 1, -1):
            at = self.after.get(tuple(self.ids[-n:]))
            if at is not None:
                out = self.ids[at : at + count]
                while len(out) < count:  # overlapping copy: the source catches up with the output
                    out.append(out[at + len(out) - len(self.ids)])
                return out
        return []


def place_lookup(tree: DraftTree, lookup: ContextLookup, cfg: TreeConfig, room: int) -> DraftTree:
    """The round's tree with the context lookup's tokens: its own branch of up to ``cfg.lookup`` tokens (within
    ``room``, the rows the context has left), or, for ``lookup_first``, in place of the drafted chain's tokens."""
    if cfg.lookup_first:
        chain = lookup.propose(tree.size - 1)
        root = DraftTree(tree.tokens[:1], [-1], tree.mask[:1, :1], tree.depth[:1])
        return graft(root, chain) if chain else tree
    return graft(tree, lookup.propose(min(cfg.lookup, room - tree.size)))


def graft(tree: DraftTree, chain: list[int]) -> DraftTree:
    """Add ``chain`` as a path under the root, reusing the nodes the tree already has for its prefix."""
    tokens, parents = tree.tokens.tolist(), tree.parents
    node, i = 0, 0
    while i < len(chain):
        nxt = next((c for c in range(node + 1, len(tokens)) if parents[c] == node and tokens[c] == chain[i]), None)
        if nxt is None:
            break
        node, i = nxt, i + 1
    rest = chain[i:]
    if not rest:
        return tree
    n0, device = len(tokens), tree.tokens.device
    size = n0 + len(rest)
    new_parents = [node] + list(range(n0, size - 1))
    mask = torch.zeros(size, size, dtype=torch.bool, device=device)
    mask[:n0, :n0] = tree.mask
    for j, par in enumerate(new_parents):
        mask[n0 + j] = mask[par]
        mask[n0 + j, n0 + j] = True
    depth = torch.cat([tree.depth, tree.depth[node] + torch.arange(1, len(rest) + 1, device=device)])
    new_tokens = torch.cat([tree.tokens, torch.tensor(rest, dtype=tree.tokens.dtype, device=device)])
    return DraftTree(new_tokens, parents + new_parents, mask, depth)
