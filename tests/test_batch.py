"""The batched decoder: each request decodes as it would alone, whatever joins, leaves or shares its rounds."""

from __future__ import annotations

import pytest
import torch
from test_engine import chi2_pvalue, exact_joint, make_decoder

from spechead.bench.suites import load_suite
from spechead.cli.bench import default_eval_dir
from spechead.decoding.decoder import Decoder
from spechead.decoding.guard import GuardConfig
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.session import resolve_drafter
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.base import make_head
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target


def batch_for(dec: Decoder, head: str = "full", tree: TreeConfig | None = None, max_batch: int = 3) -> Decoder:
    """A batched decoder over the same target and drafter as ``dec``."""
    weight, row_ids = dec.drafter.head_weight(dec.target)
    vocab = dec.target.config.vocab_size
    make = lambda: make_head(head, weight, row_ids, vocab)  # noqa: E731
    stops = list(dec.stop_ids)
    return Decoder(dec.target, dec.drafter, make, tree or dec.tree, dec.max_len, stops, max_batch=max_batch)


def prompts_of(vocab: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 25, (1,), generator=g)),), generator=g) for _ in range(n)]


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
@pytest.mark.parametrize(
    "tree",
    [TreeConfig(2, 2, 6, lookup=4), TreeConfig.chain(3), TreeConfig(4, 3, 12), TreeConfig(1, 1, 3, lookup_first=True)],
    ids=str,
)
@pytest.mark.paths
def test_batched_greedy_equals_batch1_autoregressive(tiny_small_vocab_dir, arch, tree):
    """Seven prompts of different lengths and budgets through three lanes: requests join as others leave, and
    every output is the request's own batch-1 AR output (and so is the batched AR decoder's)."""
    dec = make_decoder(tiny_small_vocab_dir, arch, tree)
    prompts = prompts_of(dec.target.config.vocab_size, 7)
    budgets = [40, 5, 33, 1, 20, 40, 12]
    want = [dec.generate(p, n, speculative=False).tokens for p, n in zip(prompts, budgets, strict=True)]
    batch, ar = batch_for(dec, tree=tree), Decoder(dec.target, max_len=dec.max_len, max_batch=3)
    rids = [batch.submit(p, n) for p, n in zip(prompts, budgets, strict=True)]
    results, seen = {}, set()
    while batch.busy:
        for e in batch.step():
            if e.result is not None:
                results[e.rid] = e.result
        seen.add(batch.occupancy)
    assert [results[r].tokens for r in rids] == want
    assert max(seen) == 3 and max(max(r.accept_lengths, default=1) for r in results.values()) > 1
    for p, n, w in zip(prompts, budgets, want, strict=True):
        assert ar.generate_batch([p], n)[0].tokens == w


def test_stop_tokens_cancel_and_context_per_request(tiny_small_vocab_dir):
    """A stop token ends one request, not the batch; a cancelled request frees its lane for a waiting one; a
    request that reaches the context stops there, as at batch 1."""
    dec = make_decoder(tiny_small_vocab_dir, max_len=64)
    prompts = prompts_of(dec.target.config.vocab_size, 4, seed=1)
    ar = [dec.generate(p, 30, speculative=False).tokens for p in prompts]
    stop = ar[0][4]
    dec.stop_ids = {stop}
    want = [dec.generate(p, 30, speculative=False) for p in prompts]
    batch = batch_for(dec, max_batch=2)
    rids = [batch.submit(p, 30) for p in prompts]
    results = {e.rid: e.result for e in batch.step() if e.result is not None}
    assert rids[1] not in results
    batch.cancel(rids[1])
    while batch.busy:
        results.update((e.rid, e.result) for e in batch.step() if e.result is not None)
    assert results[rids[1]].stop_reason == "cancelled"
    for i in (0, 2, 3):
        assert results[rids[i]].tokens == want[i].tokens and results[rids[i]].stop_reason == want[i].stop_reason
    assert results[rids[0]].stop_reason == "stop_token"
    long = torch.arange(60) % dec.target.config.vocab_size
    dec.stop_ids = set()
    alone = dec.generate(long, 30, speculative=False)
    [together, _] = batch_for(dec).generate_batch([long, prompts[2]], 30)
    assert together.tokens == alone.tokens and together.stop_reason == alone.stop_reason == "context"


def test_mixed_sampling_settings_in_one_batch(tiny_small_vocab_dir):
    """Greedy requests next to sampled ones, under a tree that shrinks as the batch fills: the greedy outputs are
    unchanged, and a seeded sampled request gives its batch-1 AR text whatever shares its rounds (its draws depend
    on its seed and positions only, not on the trees its rounds drew)."""
    dec = make_decoder(tiny_small_vocab_dir)
    prompts = prompts_of(dec.target.config.vocab_size, 4, seed=2)
    greedy = [dec.generate(p, 20, speculative=False).tokens for p in prompts]
    hot = SamplingConfig(1.0, seed=7)
    rule = lambda n: TreeConfig(2, 2, 6, lookup=4) if n == 1 else TreeConfig.chain(1)  # noqa: E731
    batch = batch_for(dec, tree=rule, max_batch=4)
    rids = [batch.submit(p, 20, hot if i % 2 else None) for i, p in enumerate(prompts)]
    results = {}
    while batch.busy:
        results.update((e.rid, e.result) for e in batch.step() if e.result is not None)
    assert results[rids[0]].tokens == greedy[0] and results[rids[2]].tokens == greedy[2]
    alone = batch_for(dec, tree=rule, max_batch=1).generate_batch([prompts[1]], 20, hot)[0]
    assert results[rids[1]].tokens == alone.tokens == dec.generate(prompts[1], 20, hot, speculative=False).tokens
    assert results[rids[3]].tokens == dec.generate(prompts[3], 20, hot, speculative=False).tokens


def test_a_request_cancelled_while_waiting_reports_its_end(tiny_small_vocab_dir):
    """A caller releases requests on their result events: one cancelled before it joined gets one too (it was
    dropped silently, and the server's slot for it was never freed)."""
    dec = make_decoder(tiny_small_vocab_dir)
    batch = batch_for(dec, max_batch=1)
    first, waiting = batch.submit([1, 2, 3], 4), batch.submit([4, 5], 4)
    batch.cancel(waiting)
    results = {}
    while batch.busy:
        results.update((e.rid, e.result) for e in batch.step() if e.result is not None)
    assert results[waiting].stop_reason == "cancelled" and results[waiting].tokens == []
    assert results[first].tokens == dec.generate([1, 2, 3], 4, speculative=False).tokens
    rid = batch.submit([1, 2, 3], 8)
    batch.step()
    assert batch.last_round == 1  # the server's occupancy metric: requests the round decoded
    batch.cancel(rid)
    [event] = batch.step()
    assert batch.last_round == 0 and event.result.stop_reason == "cancelled" and not batch.busy


def test_batched_sampling_matches_target_distribution(tiny_small_vocab_dir):
    """2,000 seeded requests, eight at a time: the law of the output is the target's (chi-square), and the
    test has power against a slightly different law."""
    cfg = SamplingConfig(1.0)
    dec = make_decoder(tiny_small_vocab_dir, tree=TreeConfig(8, 1, 12))
    prompt = torch.tensor([3, 1, 4, 1, 5])
    law = exact_joint(dec, prompt, cfg)
    batch = batch_for(dec, tree=TreeConfig(8, 1, 12), max_batch=8)
    rids = [batch.submit(prompt, 3, SamplingConfig(1.0, seed=i)) for i in range(2000)]
    results = {}
    while batch.busy:
        results.update((e.rid, e.result) for e in batch.step() if e.result is not None)
    runs = [results[r] for r in rids]
    assert 200 < sum(max(r.accept_lengths) > 1 for r in runs) < 1800  # the rejection rule is exercised
    samples = [r.tokens for r in runs]
    for positions in ([1], [2], [1, 2], [0, 1, 2]):
        assert chi2_pvalue(samples, law, positions) > 1e-3, positions
    wrong = exact_joint(dec, prompt, SamplingConfig(1.3))
    assert chi2_pvalue(samples, wrong, [0, 1, 2]) < 1e-3


def test_bad_requests_are_refused_and_lose_nothing(tiny_small_vocab_dir):
    dec = make_decoder(tiny_small_vocab_dir, max_len=64)
    batch = batch_for(dec)
    rid = batch.submit([1, 2, 3], 5)
    for bad, match in (([], "empty"), (list(range(64)), "does not fit"), ([99], "outside the vocabulary")):
        with pytest.raises(SpecheadError, match=match):
            batch.submit(torch.tensor(bad, dtype=torch.long) % 100 if bad else bad, 5)
    with pytest.raises(SpecheadError, match="max_new_tokens"):
        batch.submit([1], 0)
    with pytest.raises(SpecheadError, match="max_batch"):
        Decoder(dec.target, max_batch=0)
    results = []
    while batch.busy:
        results += [e.result for e in batch.step() if e.result is not None]
    assert [r.tokens for r in results] == [dec.generate([1, 2, 3], 5, speculative=False).tokens]
    assert results[0].tokens and rid == 0


@pytest.mark.paths
def test_demo_target_batched_is_lossless(demo_session):
    """The real demo target with its shipped drafter and NanoSpec, four Spec-Bench prompts at once."""
    s = demo_session
    rows = load_suite("spec-bench", limit=1, eval_dir=default_eval_dir())[:4]
    prompts = [s.encode(r["turns"][0]) for r in rows]
    want = [s.decoder().generate(p, 24, speculative=False).tokens for p in prompts]
    drafter = resolve_drafter("demo", s.target)
    for head in ("full", "nanospec"):
        batch = s.decoder(drafter, head, TreeConfig(2, 1, 4, lookup=8), max_batch=4)
        assert [r.tokens for r in batch.generate_batch(prompts, 24)] == want


def test_one_target_serves_batch1_and_batched_decoders(tiny_small_vocab_dir):
    """Lanes only grow: a batch-1 decoder built after a batched one leaves its lanes in place."""
    target, _ = load_target(str(tiny_small_vocab_dir))
    target.setup_cache(128)
    drafter = random_drafter(target, "eagle2", seed=0)
    weight, ids = drafter.head_weight(target)
    batch = Decoder(target, drafter, lambda: make_head("full", weight, ids, 16), TreeConfig(2, 1, 4), 128, max_batch=4)
    alone = Decoder(target, drafter, make_head("full", weight, ids, 16), TreeConfig(2, 1, 4), 128)
    assert target.lanes == 4
    prompts = prompts_of(16, 4, seed=3)
    assert [r.tokens for r in batch.generate_batch(prompts, 10)] == [alone.generate(p, 10).tokens for p in prompts]


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_batch_guard_sends_losing_rounds_to_ar_and_changes_no_output(tiny_small_vocab_dir, arch):
    """Speculation made to look slower than AR (margin 1e6) or faster (1e-6): the guard sends most rounds to AR in
    the first case, only its measuring stretches in the second, and every request's output is its batch-1 AR
    output in both, with requests joining and leaving (so rounds run at several occupancies, each its own guard)."""
    tree = TreeConfig(2, 2, 6, lookup=4)
    dec = make_decoder(tiny_small_vocab_dir, arch, tree)
    prompts = prompts_of(dec.target.config.vocab_size, 7, seed=3)
    budgets = [40, 5, 33, 3, 20, 40, 12]
    want = [dec.generate(p, n, speculative=False).tokens for p, n in zip(prompts, budgets, strict=True)]
    weight, row_ids = dec.drafter.head_weight(dec.target)
    make = lambda: make_head("nanospec", weight, row_ids, dec.target.config.vocab_size)  # noqa: E731
    share = {}
    for margin in (1e6, 1e-6):
        cfg = GuardConfig(window=2, ar_steps=2, max_ar_steps=8, margin=margin)
        batch = Decoder(dec.target, dec.drafter, make, tree, dec.max_len, list(dec.stop_ids), cfg, max_batch=3)
        rids = [batch.submit(p, n) for p, n in zip(prompts, budgets, strict=True)]
        results = {}
        while batch.busy:
            results.update((e.rid, e.result) for e in batch.step() if e.result is not None)
        assert [results[r].tokens for r in rids] == want
        rounds = [results[r].mode_rounds for r in rids]
        share[margin] = sum(m["ar"] for m in rounds) / sum(m["ar"] + m["speculative"] for m in rounds)
        assert sum(m["speculative"] for m in rounds) > 0  # the first window and the probes speculate
        assert len(batch.guards) > 1
    assert share[1e6] > 0.5 > share[1e-6], share
