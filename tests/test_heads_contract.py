"""Every registered head through the same checks: nothing here names a head, so a new head file is tested
by being added. Top-k against the plain-way logits, greedy decoding equal to AR on a tiny target, bad
options refused without weights, and the head benchmark's cases and byte counts."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_llama

from spechead.decoding.batch import BatchDecoder
from spechead.decoding.decoder import Decoder
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads import HEADS, make_head
from spechead.heads.base import BenchSettings, check_head_spec
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target

pytestmark = pytest.mark.usefixtures("one_thread")
V, D = 49152, 32  # the demo's vocabulary, for which default token lists ship (fr, vocabtrim, hybrid's backstop)
NAMES = sorted(HEADS)


@pytest.fixture(scope="module")
def weight():
    return torch.randn(V, D, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("tinyV"), vocab=V, layers=2, hidden=D, std=0.5, seed=3)
    return load_target(str(folder))[0]


def check_topk(head, h: torch.Tensor, k: int = 8) -> None:
    ref = torch.log_softmax(head.reference_logits(h), dim=-1)
    logp, ids = head.topk(h, k)
    want_logp, want_ids = ref.topk(k, dim=-1)
    torch.testing.assert_close(logp.float(), want_logp, atol=2e-4, rtol=1e-4)
    assert ids.tolist() == want_ids.tolist()


def test_registry_is_not_empty_and_names_are_specs():
    assert {"full", "fr", "vocabtrim", "lowrank", "nanospec", "hybrid"} <= set(NAMES)
    for name in NAMES:
        assert HEADS[name].name == name and ":" not in name


@pytest.mark.parametrize("name", NAMES)
def test_topk_equals_brute_force_through_a_request(name, weight):
    """Top-k log-probs and ids equal the plain-way computation before and after the head adapts (begin, observe)."""
    g = torch.Generator().manual_seed(1)
    head = make_head(name, weight, None, V)
    prompt = torch.randint(0, V, (40,), generator=g)
    head.begin(prompt, torch.randn(40, V, generator=g) if head.needs_prompt_logits else None)
    for _ in range(3):
        check_topk(head, torch.randn(1, D, generator=g))
        check_topk(head, torch.randn(4, D, generator=g))
        tree = torch.randint(0, V, (6,), generator=g)
        head.observe(tree, torch.randn(6, V, generator=g), tree[:2].tolist())


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_autoregressive(name, target):
    drafter = random_drafter(target, "eagle2", seed=4)
    weight, row_ids = drafter.head_weight(target)
    prompts = ([5, 17, 300, 5, 17], [1000, 2, 2, 9])
    ar = Decoder(target, max_len=128)
    want = [ar.generate(p, 16, speculative=False).tokens for p in prompts]
    dec = Decoder(target, drafter, make_head(name, weight, row_ids, V), TreeConfig(2, 2, 4, lookup=4), 128)
    assert [dec.generate(p, 16).tokens for p in prompts] == want


@pytest.mark.parametrize("name", NAMES)
def test_batched_greedy_equals_autoregressive(name, target):
    """Batched (three requests at a time, five of different lengths joining as others leave): each request's
    output is its batch-1 AR output, the head shared by every request or, if it keeps state, one per request."""
    drafter = random_drafter(target, "eagle2", seed=4)
    weight, row_ids = drafter.head_weight(target)
    prompts = ([5, 17, 300, 5, 17], [1000, 2, 2, 9], [7], [40, 41, 42, 40, 41, 42, 40], [9, 9])
    ar = Decoder(target, max_len=128)
    want = [ar.generate(p, 12, speculative=False).tokens for p in prompts]
    batch = BatchDecoder(target, drafter, lambda: make_head(name, weight, row_ids, V), TreeConfig(2, 2, 4, lookup=4), 3)
    assert [r.tokens for r in batch.generate(prompts, 12)] == want


@pytest.mark.parametrize("name", NAMES)
def test_bad_options_are_refused_without_weights(name, weight):
    for spec in (f"{name}:no_such_option=1", f"{name}:1:2:3"):
        with pytest.raises(SpecheadError):
            check_head_spec(spec)
        with pytest.raises(SpecheadError):
            make_head(spec, weight, None, V)
    with pytest.raises(SpecheadError, match="unknown head"):
        check_head_spec(f"{name}x")
    assert check_head_spec(name) == name


@pytest.mark.parametrize("name", NAMES)
def test_bench_cases_run_and_count_their_bytes(name, weight):
    """The head benchmark's cases build at a given shape, run, and move at least their logits' bytes."""
    settings = BenchSettings(subset=4096, w_max=512)
    cases = HEADS[name].bench_cases(weight, V, settings, torch.Generator().manual_seed(2))
    assert cases
    full = make_head("full", weight, None, V)
    for case in cases:
        assert case.spec.partition(":")[0] == name and check_head_spec(case.spec)
        if case.head.per_round:
            case.head.begin(torch.arange(settings.w_max), None)
        for batch in (1, 3):
            logp, ids = case.head.topk(torch.randn(batch, D), 4)
            assert logp.shape == ids.shape == (batch, 4)
            nbytes, flops = case.head.call_bytes(batch, settings), case.head.call_flops(batch, settings)
            assert 0 < nbytes and 0 < flops
            assert (nbytes < full.call_bytes(batch, settings)) == (name != "full")  # every other head reads less
        assert HEADS[name].bench_key(case.spec, [c.spec for c in cases]) == case.spec
