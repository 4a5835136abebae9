"""Every registered head through the same checks: nothing here names a head, so a new head file is tested
by being added. Top-k against the plain-way logits, greedy decoding equal to AR on a tiny target, bad
options refused without weights (the head benchmark's cases: test_headbench.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import write_tiny_llama

from spechead.decoding.decoder import Decoder
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads import HEADS, make_head
from spechead.heads.base import check_head_spec
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


@pytest.mark.paths
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_autoregressive(name, target):
    drafter = random_drafter(target, "eagle2", seed=4)
    weight, row_ids = drafter.head_weight(target)
    prompts = ([5, 17, 300, 5, 17], [1000, 2, 2, 9])
    ar = Decoder(target, max_len=128)
    want = [ar.generate(p, 16, speculative=False).tokens for p in prompts]
    dec = Decoder(target, drafter, make_head(name, weight, row_ids, V), TreeConfig(2, 2, 4, lookup=4), 128)
    assert [dec.generate(p, 16).tokens for p in prompts] == want


@pytest.mark.paths
@pytest.mark.parametrize("name", NAMES)
def test_batched_greedy_equals_autoregressive(name, target):
    """Batched (three requests at a time, five of different lengths joining as others leave): each request's
    output is its batch-1 AR output, the head shared by every request or, if it keeps state, one per request."""
    drafter = random_drafter(target, "eagle2", seed=4)
    weight, row_ids = drafter.head_weight(target)
    prompts = ([5, 17, 300, 5, 17], [1000, 2, 2, 9], [7], [40, 41, 42, 40, 41, 42, 40], [9, 9])
    ar = Decoder(target, max_len=128)
    want = [ar.generate(p, 12, speculative=False).tokens for p in prompts]
    make = lambda: make_head(name, weight, row_ids, V)  # noqa: E731
    batch = Decoder(target, drafter, make, TreeConfig(2, 2, 4, lookup=4), 128, max_batch=3)
    assert [r.tokens for r in batch.generate_batch(prompts, 12)] == want


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
