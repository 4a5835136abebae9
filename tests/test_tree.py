"""Tree construction: parent mapping, ancestor masks, depths, tie handling."""

import pytest
import torch

from spechead.tree import TreeConfig, build_tree


def ancestors(parents, node):
    out = {node}
    while parents[node] >= 0:
        node = parents[node]
        out.add(node)
    return out


def check_tree(tree):
    n = tree.size
    for j in range(n):
        assert tree.parents[j] < j  # parents precede children; root's parent is -1
        assert set(torch.nonzero(tree.mask[j]).flatten().tolist()) == ancestors(tree.parents, j)
        assert int(tree.depth[j]) == len(ancestors(tree.parents, j)) - 1


def test_build_tree_hand_made():
    # candidates: 0,1 children of root; 2,3 children of cand 0; 4 child of cand 3
    tokens = torch.tensor([10, 11, 12, 13, 14])
    parents = torch.tensor([-1, -1, 0, 0, 3])
    scores = torch.tensor([-0.1, -2.0, -0.5, -0.3, -0.4])
    tree = build_tree(99, tokens, parents, scores, 4)
    # best 4: cand 0 (-0.1), 3 (-0.3), 4 (-0.4), 2 (-0.5) -> nodes in candidate order 0,2,3,4
    assert tree.tokens.tolist() == [99, 10, 12, 13, 14]
    assert tree.parents == [-1, 0, 1, 1, 3]
    check_tree(tree)


def test_ties_never_orphan_a_child():
    """A child whose score equals its parent's (log-prob 0) must not be kept without the parent."""
    tokens = torch.arange(6)
    parents = torch.tensor([-1, -1, -1, 1, 1, 3])
    scores = torch.tensor([-1.0, -0.5, -0.5, -0.5, -3.0, -0.5])
    for n in range(1, 7):
        tree = build_tree(0, tokens, parents, scores, n)
        check_tree(tree)


def test_random_pools_are_closed_under_parents():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        k, depth = 3, 3
        scores, parents = [], []
        level = torch.rand(k, generator=g).log()
        scores.append(level)
        parents.append(torch.full((k,), -1))
        cur, cur_idx = level, torch.arange(k)
        for _ in range(depth):
            child = torch.rand(k, k, generator=g).clamp_min(1e-9).log()
            child[:, 0] = 0.0  # ties with the parent
            cu = (cur[:, None] + child).flatten()
            scores.append(cu)
            parents.append(cur_idx.repeat_interleave(k))
            best = torch.sort(cu, descending=True, stable=True).indices[:k]
            cur_idx = sum(s.numel() for s in scores[:-1]) + best
            cur = cu[best]
        tree = build_tree(7, torch.arange(sum(s.numel() for s in scores)), torch.cat(parents), torch.cat(scores), 12)
        check_tree(tree)


def test_tree_config_parsing():
    assert TreeConfig.parse("4,3,12") == TreeConfig(4, 3, 12)
    assert TreeConfig.parse("4x3x12") == TreeConfig(4, 3, 12)
    assert TreeConfig.parse("chain:5") == TreeConfig(1, 4, 6)
    with pytest.raises(ValueError):
        TreeConfig.parse("4,3")
    with pytest.raises(ValueError):
        TreeConfig(0, 1, 1)
