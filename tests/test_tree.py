"""Tree construction: parent mapping, ancestor masks, depths, tie handling."""

import pytest
import torch

from spechead.decoding.tree import ContextLookup, TreeConfig, build_tree, graft


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
    assert TreeConfig.parse("2x4x8+lookup:6") == TreeConfig(2, 4, 8, 6)
    assert TreeConfig.parse("chain:3+lookup:2") == TreeConfig(1, 2, 4, 2)
    assert TreeConfig.parse(str(TreeConfig(2, 4, 8, 6))) == TreeConfig(2, 4, 8, 6)
    assert TreeConfig(2, 4, 8, 6).max_rows == 14
    first = TreeConfig.parse("chain:2+lookup-first")
    assert first == TreeConfig(1, 1, 3, lookup_first=True) and first.max_rows == 3 and first.uses_lookup
    assert TreeConfig.parse(str(first)) == first and first.lean() == TreeConfig(1, 0, 2, lookup_first=True)
    for bad in ("4,3", "2x4x8+lookup", "2x4x8+pld:3", "2x4x8+lookup:-1", "2x4x8+lookup-first"):
        with pytest.raises(ValueError):
            TreeConfig.parse(bad)
    with pytest.raises(ValueError):
        TreeConfig(0, 1, 1)


def brute_lookup(ids, count, max_n=3, min_n=2):
    for n in range(min(max_n, len(ids)), min_n - 1, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # latest earlier occurrence with a successor
            if ids[start : start + n] == suffix:
                full = list(ids)
                for j in range(count):  # what follows it, copying on into the proposal itself
                    full.append(full[start + n + j])
                return full[len(ids) :]
    return []


def test_context_lookup_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        vocab = 3 + trial % 6
        ids = torch.randint(0, vocab, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        lk = ContextLookup()
        cut = len(ids) // 2
        lk.extend(ids[:cut])  # incremental extension gives the same index as one pass
        lk.extend(ids[cut:])
        for count in (0, 1, 4):
            assert lk.propose(count) == brute_lookup(ids, count), (ids, count)
    lk = ContextLookup()
    lk.extend([5, 6, 7, 8, 1, 5, 6])
    assert lk.propose(3) == [7, 8, 1]  # the classic copy case
    lk.extend([7, 9, 7, 9])
    assert lk.propose(5) == [7, 9, 7, 9, 7]  # a repeating run goes on repeating past the end


def test_graft_shares_prefix_and_keeps_tree_valid():
    scores = torch.tensor([-0.1, -2, -0.2, -0.3])
    tree = build_tree(99, torch.tensor([10, 11, 12, 13]), torch.tensor([-1, -1, 0, 2]), scores, 4)
    assert tree.tokens.tolist() == [99, 10, 11, 12, 13]  # 99 -> 10 -> 12 -> 13, 99 -> 11
    same = graft(tree, [10, 12])
    assert same is tree  # the chain is already in the tree
    g = graft(tree, [10, 12, 7, 8])  # shares 10 -> 12, then continues under node 3 (token 12)
    assert g.tokens.tolist() == [99, 10, 11, 12, 13, 7, 8]
    assert g.parents == [-1, 0, 0, 1, 3, 3, 5]
    check_tree(g)
    g = graft(tree, [11, 4])
    assert g.parents[-1] == 2 and g.tokens.tolist()[-1] == 4
    check_tree(g)
    none = torch.empty(0, dtype=torch.long)
    check_tree(graft(build_tree(1, none, none, torch.empty(0), 0), [2, 3]))  # a root-only tree
