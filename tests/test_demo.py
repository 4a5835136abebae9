"""Integration on the real demo target (SmolLM2-135M-Instruct): speculative output equals greedy AR."""

import pytest

from spechead.bench.suites import load_suite
from spechead.cli.bench import default_eval_dir
from spechead.decoding.session import resolve_drafter
from spechead.decoding.tree import TreeConfig


@pytest.mark.paths
@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_demo_speculative_is_lossless(demo_session, arch):
    s = demo_session
    prompts = load_suite("spec-bench", limit=1, categories=["writing", "math_reasoning"], eval_dir=default_eval_dir())
    drafter = resolve_drafter("random", s.target, arch)
    for p in prompts:
        ids = s.encode(p["turns"][0])
        reference = s.decoder().generate(ids, 20, speculative=False).tokens
        for tree in (TreeConfig(4, 4, 16), TreeConfig.chain(3), TreeConfig(2, 2, 5, lookup=8)):
            assert s.decoder(drafter, "full", tree).generate(ids, 20).tokens == reference


@pytest.mark.paths
def test_demo_drafter_is_lossless(demo_session):
    """Whatever drafter ships as the demo default (trained, or random until one ships)."""
    s = demo_session
    dec = s.decoder(resolve_drafter("demo", s.target))
    ids = s.encode("Give me two tips for learning to cook.")
    res = dec.generate(ids, 32)
    assert res.tokens == s.decoder().generate(ids, 32, speculative=False).tokens
    assert res.stop_reason in ("max_new_tokens", "stop_token")
