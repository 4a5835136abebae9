"""NanoSpec and hybrid heads: top-k against brute force over the defined candidate set, state
invariants under adversarial streams, coverage telemetry, bad input, greedy losslessness."""

import math

import pytest
import torch

from spechead import kernels
from spechead.decoding.decoder import Decoder
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.base import make_head
from spechead.heads.hybrid import HYBRID_FREQ, HybridHead, frequent_ids
from spechead.heads.nanospec import NanoSpecHead
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target

V, D = 200, 16


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_target(str(tiny_dir))[0]


def weight(seed=0, rows=V):
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(seed))


def check_invariants(head: NanoSpecHead, w: torch.Tensor) -> set[int]:
    """No duplicates, mask == buffer, slot map consistent, packed rows == the head's rows; returns the set."""
    ids, n = head.state()
    assert n <= head.w_max
    assert ids.unique().numel() == n
    assert torch.equal(head.in_set.nonzero().flatten(), ids.sort().values)
    assert torch.equal(head.slot_of[ids], torch.arange(n))
    assert int((head.slot_of >= 0).sum()) == n
    rows = ids if head.t2r is None else head.t2r[ids]
    assert torch.equal(head.packed.read(n), w[rows])
    return set(ids.tolist())


def brute_topk(h, w, row_of: dict[int, int], cand: list[int], k: int):
    """log-softmax over exactly the candidate ids, top-k: the definition the heads must match."""
    z = h @ w[[row_of[c] for c in cand]].T
    lp = torch.log_softmax(z.float(), dim=-1)
    top, idx = lp.topk(min(k, len(cand)), dim=-1)
    return top, torch.tensor(cand)[idx]


def feed(head, g, rounds=6, nodes=5):
    """Random rounds; returns the union of every Ext candidate (tree tokens, committed, top-k)."""
    seen = set()
    for _ in range(rounds):
        tree = torch.randint(0, V, (nodes,), generator=g)
        logits = torch.randn(nodes, V, generator=g)
        committed = tree[: 1 + int(torch.randint(0, nodes, (1,), generator=g))].tolist()
        top = logits.topk(head.ext_topk, dim=-1).indices
        seen |= set(tree.tolist()) | set(committed) | set(top.flatten().tolist())
        head.observe(tree, logits, committed)
    return seen


@pytest.mark.parametrize("cls", [NanoSpecHead, HybridHead])
def test_set_sources_and_topk_match_brute_force(cls):
    """Ctx (prompt ids, the target's top-3 at the prompt rows) then Ext (committed, the target's top-k at the
    nodes, the tree) build the set; top-k is the log-softmax over exactly that set."""
    g = torch.Generator().manual_seed(1)
    w = weight()
    head = cls(w, None, V, w_max=V)
    prompt = torch.randint(0, V, (7,), generator=g)
    plog = torch.randn(7, V, generator=g)
    head.begin(prompt, plog)
    expected = set(prompt.tolist()) | set(plog.topk(3, dim=-1).indices.flatten().tolist())
    assert check_invariants(head, w) == expected
    expected |= feed(head, g)
    got = check_invariants(head, w)
    assert got == expected
    h = torch.randn(3, D, generator=g)
    logp, ids = head.topk(h, 4)
    ref_lp, ref_ids = brute_topk(h, w, {i: i for i in range(V)}, sorted(got), 4)
    torch.testing.assert_close(logp, ref_lp)
    assert torch.equal(ids, ref_ids)


def test_reduced_drafter_vocab_only_adds_what_the_drafter_has():
    g = torch.Generator().manual_seed(2)
    row_ids = torch.randperm(V, generator=g)[:60].sort().values  # drafter row -> target id
    w = weight(rows=60)
    head = NanoSpecHead(w, row_ids, V, w_max=V)
    prompt = torch.randint(0, V, (10,), generator=g)
    plog = torch.randn(10, V, generator=g)
    head.begin(prompt, plog)
    seen = set(prompt.tolist()) | set(plog.topk(3, dim=-1).indices.flatten().tolist()) | feed(head, g)
    got = check_invariants(head, w)
    assert got == seen & set(row_ids.tolist())
    h = torch.randn(2, D, generator=g)
    row_of = {int(t): i for i, t in enumerate(row_ids)}
    logp, ids = head.topk(h, 3)
    ref_lp, ref_ids = brute_topk(h, w, row_of, sorted(got), 3)
    torch.testing.assert_close(logp, ref_lp)
    assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("policy", ["stop", "lru"])
def test_adversarial_stream_never_overflows_and_reset(policy):
    g = torch.Generator().manual_seed(3)
    w = weight()
    head = NanoSpecHead(w, None, V, w_max=16, policy=policy, pinned=torch.tensor([5, 6]))
    head.begin(torch.arange(30), torch.randn(30, V, generator=g))  # Ctx alone exceeds W_max
    after_ctx = check_invariants(head, w)
    assert head.n == 16 and head.dropped > 0 and {5, 6} <= after_ctx
    for r in range(12):  # every candidate new: a stream designed to overflow
        tree = torch.arange(40 + 13 * r, 53 + 13 * r) % V
        logits = torch.randn(13, V, generator=g)
        head.observe(tree, logits, tree[:2].tolist())
        got = check_invariants(head, w)
        assert {5, 6} <= got  # pinned tokens are never evicted
        logp, ids = head.topk(torch.randn(2, D, generator=g), 4)
        assert set(ids.flatten().tolist()) <= got and bool((logp <= 0).all())
    if policy == "lru":
        assert head.evicted > 0 and set(tree[:2].tolist()) <= got  # this round's committed tokens got in
    else:
        assert head.evicted == 0 and got == after_ctx  # stop: a full set no longer changes
    plog = torch.zeros(2, V).index_fill_(1, torch.tensor([7, 8, 9]), 3.0)
    head.begin(torch.tensor([100, 101]), plog)  # a new request starts from the pinned ids only
    assert check_invariants(head, w) == {5, 6, 7, 8, 9, 100, 101}
    assert head.stats()["rounds"] == 0 and head.dropped == 0 and head.evicted == 0


@pytest.mark.paths
@pytest.mark.skipif(not kernels.available(), reason="the C++ set update needs spechead's kernels")
@pytest.mark.parametrize("policy", ["stop", "lru"])
@pytest.mark.parametrize("reduced", [False, True])
def test_cpp_set_update_equals_the_python_reference(policy, reduced, monkeypatch):
    """On the CPU the set update runs as one C++ op (kernels.py); it must leave exactly the state the
    documented Python steps leave (same ids in the same slots, mask, slot map, LRU rounds, counters)."""
    g = torch.Generator().manual_seed(11)
    rows = 120 if reduced else V
    w = weight(5, rows)
    row_ids = torch.randperm(V, generator=g)[:rows] if reduced else None
    pinned = row_ids[:3] if reduced else torch.tensor([5, 6, 7])
    prompt, plog = torch.randint(0, V, (9,), generator=g), torch.randn(9, V, generator=g)
    stream = [(torch.randint(0, V, (11,), generator=g), torch.randn(11, V, generator=g)) for _ in range(25)]

    def run(native: bool) -> NanoSpecHead:
        with monkeypatch.context() as m:
            if not native:
                m.setattr(kernels, "available", lambda: False)
            head = NanoSpecHead(w, row_ids, V, w_max=24, policy=policy, pinned=pinned)
            head.begin(prompt, plog)
            for tree, logits in stream:
                head.observe(tree, logits, tree[:3].tolist())
            head.state()
            return head

    cpp, ref = run(True), run(False)
    assert cpp.n == ref.n and (cpp.evicted, cpp.dropped) == (ref.evicted, ref.dropped)
    assert torch.equal(cpp.ids[: cpp.n], ref.ids[: ref.n])
    assert torch.equal(cpp.in_set, ref.in_set) and torch.equal(cpp.slot_of, ref.slot_of)
    assert torch.equal(cpp.last_hit[:-1], ref.last_hit[:-1])  # [-1] is the reference's scratch slot
    assert torch.equal(cpp.packed.read(cpp.n), ref.packed.read(ref.n))
    assert policy == "stop" or cpp.evicted > 0  # the stream did overflow


def test_lru_evicts_least_recently_hit():
    w = weight()
    head = NanoSpecHead(w, None, V, w_max=5, ctx_topk=0, policy="lru", ext_from="tokens")
    head.begin(torch.tensor([0]), None)  # round 0: {0}

    def round_(tree):
        head.observe(torch.tensor(tree), torch.zeros(len(tree), V), [tree[0]])

    round_([10, 11])  # round 1: {0, 10, 11}
    round_([12, 13])  # round 2: {0, 10, 11, 12, 13} full
    round_([11, 13])  # round 3 hits 11, 13
    round_([20, 21])  # round 4: evicts the two least recently hit (0 in round 0, 10 in round 1)
    assert check_invariants(head, w) == {11, 12, 13, 20, 21}
    assert head.evicted == 2


def test_ext_from_tokens_takes_no_target_logits_and_extend_adds_ids():
    """``ext_from=tokens`` (what vLLM can feed): committed tokens and drafts join the set, the target's argmax at
    the nodes does not; ``extend`` adds ids the way vLLM's drafter sees them."""
    w = weight()
    head = NanoSpecHead(w, None, V, w_max=V, ctx_topk=0, ext_from="tokens")
    head.begin(torch.tensor([1, 2]), None)
    logits = torch.zeros(2, V)
    logits[0, 30], logits[1, 31] = 1.0, 1.0  # the target's argmax at the two nodes
    head.observe(torch.tensor([5, 6]), logits, [5, 7])
    assert check_invariants(head, w) == {1, 2, 5, 6, 7}
    head.extend(torch.tensor([9, 2], dtype=torch.int32))  # vLLM's ids are int32
    assert check_invariants(head, w) == {1, 2, 5, 6, 7, 9}
    with pytest.raises(SpecheadError, match="ext_from"):
        NanoSpecHead(w, None, V, ext_from="nodes")


def test_coverage_telemetry_on_a_hand_made_sequence():
    w = weight()
    head = NanoSpecHead(w, None, V, w_max=V, ctx_topk=0, ext_from="tokens")
    head.begin(torch.tensor([1, 2, 3]), None)
    nodes = torch.zeros(2, V)  # the target's logits: unread with ext_from=tokens
    head.observe(torch.tensor([3, 4]), nodes, [1, 7])  # 1 in, 7 out
    assert check_invariants(head, w) == {1, 2, 3, 4, 7}
    head.observe(torch.tensor([7, 8]), nodes, [7, 8, 2])  # 7 and 2 in, 8 out
    # no draft call between this round and the last (an AR stretch): their updates merge, so this one sees the
    # set the last one saw
    head.observe(torch.tensor([2]), nodes[:1], [99])  # out
    trace = head.trace
    assert [t["active"] for t in trace] == [3, 5, 5]
    assert [t["hits"] for t in trace] == [1, 2, 0]
    assert [t["coverage"] for t in trace] == pytest.approx([1 / 2, 3 / 5, 3 / 6])
    st = head.stats()  # applies the merged update: 8 and 99 join
    assert st["coverage"] == pytest.approx(0.5)
    assert st["active_mean"] == pytest.approx(13 / 3)
    assert st["active_size"] == 7 and st["rounds"] == 3


def test_hybrid_pins_the_most_frequent_ids():
    """Where the vocabulary has a frequency list, the hybrid pins its first HYBRID_FREQ ids (those the drafter
    has) in every request's set; a W_max without room for them pins none."""
    big = 49152  # the demo's vocabulary, for which a frequency list ships
    want = frequent_ids(HYBRID_FREQ, big, None)
    w = torch.randn(big, 4, generator=torch.Generator().manual_seed(6))
    head = HybridHead(w, None, big)
    assert head.n_pin == HYBRID_FREQ and torch.equal(head.ids[:HYBRID_FREQ], want)
    head.begin(torch.tensor([1, 2]), None)
    assert set(want.tolist()) | {1, 2} == set(head.state()[0].tolist())
    assert HybridHead(w, None, big, w_max=4 * HYBRID_FREQ - 1).n_pin == 0
    row_ids = torch.arange(0, big, 2)  # a drafter with every other id: only those are pinned
    reduced = HybridHead(w[: row_ids.numel()], row_ids, big)
    assert reduced.n_pin == HYBRID_FREQ and bool((reduced.ids[:HYBRID_FREQ] % 2 == 0).all())
    assert frequent_ids(HYBRID_FREQ, V, None) is None and HybridHead(weight(), None, V).n_pin == 0


@pytest.mark.parametrize(
    "spec",
    [
        "nanospec:0",
        "nanospec:-3",
        f"nanospec:{V + 1}",
        "nanospec:abc",
        "nanospec:64:ctx_topk=x",
        "nanospec:64:ctx_topk=-1",
        "nanospec:64:ctx_topk=65",
        "nanospec:64:policy=fifo",
        "nanospec:64:gather=gpu",
        "nanospec:64:ext_from=nodes",
        "nanospec:64:bogus=1",
        "nanospec:64:3",
        "hybrid:64:policy=fifo",
        "hybrid:64:m=8",
    ],
)
def test_bad_input_is_a_clear_error(spec):
    with pytest.raises(SpecheadError):
        make_head(spec, weight(), None, V)


def test_pinned_ids_are_validated():
    with pytest.raises(SpecheadError):
        NanoSpecHead(weight(), None, V, w_max=8, pinned=torch.tensor([1, 1]))
    with pytest.raises(SpecheadError):
        NanoSpecHead(weight(), None, V, w_max=2, pinned=torch.tensor([1, 2]))


def test_the_prefill_computes_the_target_logits_at_the_rows_the_head_asks_for(target):
    g = torch.Generator().manual_seed(4)
    drafter = random_drafter(target, "eagle2", seed=0)
    dw, rows = drafter.head_weight(target)
    dec = Decoder(target, drafter, make_head("nanospec", dw, rows, target.config.vocab_size), TreeConfig(3, 3, 10), 256)
    seen = []
    begin = dec.head.begin
    dec.head.begin = lambda ids, logits: (seen.append(logits.shape[0]), begin(ids, logits))[1]
    prompt = torch.randint(0, 64, (12,), generator=g)
    assert dec.generate(prompt, 20).tokens == dec.generate(prompt, 20, speculative=False).tokens
    assert seen == [dec.head.prompt_logit_rows(12, target.config)]


def test_ctx_rows_auto_bounds_the_heads_share_of_the_prefill(target):
    """Every row where the head is small against the blocks, the last share of them where it dominates; never more than
    CTX_ROWS_CAP rows, whatever the prompt's length; ctx_topk=0 needs the last row only."""
    from dataclasses import replace

    from spechead.heads.nanospec import CTX_HEAD_SHARE, CTX_ROWS_CAP

    cfg = target.config
    head = NanoSpecHead(weight(), None, V, w_max=32)
    ratio = cfg.vocab_size * cfg.hidden_size / cfg.block_macs()
    for n in (1, 5, 40, 300):
        assert head.prompt_logit_rows(n, cfg) == max(1, min(n, CTX_ROWS_CAP, math.ceil(n * CTX_HEAD_SHARE / ratio)))
    big = replace(cfg, vocab_size=cfg.vocab_size * 64)  # a head 64x wider: the prefill keeps fewer rows
    small = replace(cfg, vocab_size=8)
    assert head.prompt_logit_rows(60, big) < head.prompt_logit_rows(60, cfg) == 60
    assert head.prompt_logit_rows(40, small) == 40  # a short prompt: every row
    assert head.prompt_logit_rows(3000, small) == CTX_ROWS_CAP  # a long one: the cap
    assert head.prompt_logit_rows(300, replace(cfg, vocab_size=1 << 30)) == 1  # never fewer than the last row
    assert NanoSpecHead(weight(), None, V, w_max=32, ctx_topk=0).prompt_logit_rows(300, cfg) == 1


def test_prompt_logits_must_cover_exactly_the_prompt():
    head = NanoSpecHead(weight(), None, V, w_max=32)
    with pytest.raises(ValueError):  # stale extra rows (the reference's bug B1) are refused, not used
        head.begin(torch.tensor([1, 2]), torch.randn(5, V))


LOSSLESS_SPECS = [
    "nanospec",
    "nanospec:ctx_topk=0",
    "nanospec:ext_from=tokens",
    "nanospec:8:policy=lru",
    "nanospec:8:policy=stop:gather=async",
    "hybrid",
    "hybrid:16:policy=lru",
]


@pytest.mark.paths
@pytest.mark.parametrize("spec", LOSSLESS_SPECS)
def test_greedy_output_equals_autoregressive(target, spec):
    tgt = target
    drafter = random_drafter(tgt, "eagle2", seed=0)
    w, rows = drafter.head_weight(tgt)
    head = make_head(spec, w, rows, tgt.config.vocab_size)
    dec = Decoder(tgt, drafter, head, TreeConfig(3, 3, 10), 256)
    g = torch.Generator().manual_seed(6)
    for _ in range(2):
        prompt = torch.randint(0, 64, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g)
        res = dec.generate(prompt, 30)
        assert res.tokens == dec.generate(prompt, 30, speculative=False).tokens
        assert 0 <= res.head_stats["coverage"] <= 1 and res.head_stats["active_size"] <= head.w_max
        check_invariants(head, w)


def test_greedy_lossless_with_a_reduced_vocabulary_drafter(target):
    tgt = target
    drafter = random_drafter(tgt, "eagle3", seed=1, draft_vocab_size=24)
    drafter.set_draft_vocab(torch.arange(0, 64, 2)[:24])
    w, rows = drafter.head_weight(tgt)
    for spec in ("nanospec", "hybrid"):
        head = make_head(spec, w, rows, 64)
        dec = Decoder(tgt, drafter, head, TreeConfig(3, 3, 10), 256)
        prompt = torch.arange(1, 12)
        assert dec.generate(prompt, 24).tokens == dec.generate(prompt, 24, speculative=False).tokens
        assert check_invariants(head, w) <= set(rows.tolist())


def test_async_and_sync_gather_agree(target):
    tgt = target
    drafter = random_drafter(tgt, "eagle2", seed=2)
    w, rows = drafter.head_weight(tgt)
    out = {}
    for gather in ("sync", "async"):
        head = make_head(f"nanospec:24:policy=lru:gather={gather}", w, rows, 64)
        dec = Decoder(tgt, drafter, head, TreeConfig(3, 3, 10), 256)
        res = dec.generate(torch.arange(3, 15), 30)
        out[gather] = (res.tokens, res.accept_lengths, res.head_stats, head.trace, head.state()[0].tolist())
    assert out["sync"] == out["async"]


def test_lossless_with_accepted_drafts_from_a_small_set(tiny_small_vocab_dir):
    """V=16 target where random drafts get accepted: multi-token paths drafted from a 6-id set."""
    tgt = load_target(str(tiny_small_vocab_dir))[0]
    drafter = random_drafter(tgt, "eagle2", seed=0)
    w, rows = drafter.head_weight(tgt)
    for spec in ("nanospec:6:policy=lru", "hybrid:6:policy=lru"):
        head = make_head(spec, w, rows, 16)
        dec = Decoder(tgt, drafter, head, TreeConfig(3, 3, 10), 256)
        longest = 0
        for seed in range(3):
            prompt = torch.randint(0, 16, (8,), generator=torch.Generator().manual_seed(seed))
            res = dec.generate(prompt, 40)
            assert res.tokens == dec.generate(prompt, 40, speculative=False).tokens
            longest = max(longest, *res.accept_lengths)
            check_invariants(head, w)
        assert longest >= 3


def test_oracle_replay_gives_the_full_head_every_token(target):
    """The replay's drafter state is the target's own: the full head drafts every token (tau = depth + 1)."""
    from types import SimpleNamespace

    from spechead.bench.oracle import oracle_replay

    target.setup_cache(256)
    res = oracle_replay(SimpleNamespace(target=target), [[3, 4, 5, 6]], ["full", "nanospec:8"], tokens=12, depth=3)
    assert res["full"]["tau"] == 4.0
    assert 1.0 <= res["nanospec:8"]["tau"] <= 4.0 and res["nanospec:8"]["active_size"] <= 8
