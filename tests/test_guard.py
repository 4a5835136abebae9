"""The never-slower-than-AR guard: its policy, and that switching modes never changes the output.

No timing assertions: the guard's clock is injected (one tick per reading, so every step "takes" one
second) or its AR figure is set to an extreme, which makes every switch deterministic."""

import itertools
from collections.abc import Callable

import pytest
import torch
from test_engine import chi2_pvalue, exact_joint

from spechead.decoding.decoder import Decoder
from spechead.decoding.guard import Guard, GuardConfig
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.tree import TreeConfig
from spechead.heads.base import make_head
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target

# speculation always loses: any round commits fewer than 1e6 tokens per AR step time
ALWAYS_AR = GuardConfig(window=1, ar_steps=2, max_ar_steps=8, margin=1e6)
LOOKUP_TREE = "2x1x4+lookup:8"


pytestmark = pytest.mark.usefixtures("one_thread")


def ticking() -> Callable[[], float]:
    count = itertools.count()
    return lambda: float(next(count))


def make_decoder(folder, arch="eagle2", head="full", tree="4x2x8", max_len=256, stop_ids=None, **guard):
    target, _ = load_target(str(folder))
    drafter = random_drafter(target, arch, seed=0)
    w, ids = drafter.head_weight(target)
    h = make_head(head, w, ids, target.config.vocab_size)
    return Decoder(target, drafter, h, TreeConfig.parse(tree), max_len, stop_ids, **guard)


def with_clock(dec, cfg):
    """The guard, with a clock that ticks once per reading (every step lasts one second)."""
    dec.guard = Guard(cfg, clock=ticking())
    return dec


def prompts(n, seed, vocab=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g) for _ in range(n)]


def check_counts(res):
    assert len(res.tokens) == 1 + sum(res.accept_lengths) + res.mode_rounds["ar"]
    assert res.mode_rounds["speculative"] == len(res.accept_lengths)


# -- the policy -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"window": 0},
        {"window": 2.0},
        {"ar_steps": 0},
        {"ar_steps": True},
        {"max_ar_steps": 4},  # below ar_steps (8)
        {"margin": 0.0},
        {"margin": -1.0},
        {"margin": float("nan")},
        {"margin": float("inf")},
        {"margin": "1"},
        {"enabled": 1},
        {"lean": 1},
        {"lean_rounds": 0},
    ],
    ids=str,
)
def test_config_validation(kw):
    with pytest.raises(ValueError, match="GuardConfig"):
        GuardConfig(**kw)


def test_ar_step_s_validation():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ar_step_s"):
            Guard(GuardConfig(), bad)


def run_spec(g, tokens, seconds, n=1):
    for _ in range(n):
        assert not g.ar
        g.record(tokens, seconds)


def run_ar(g, seconds=1.0):
    n = 0
    while g.ar:
        g.record(1, seconds)
        n += 1
    return n


def test_policy_backs_off_and_resets():
    g = Guard(GuardConfig(window=2, ar_steps=2, max_ar_steps=8), ar_step_s=1.0)  # AR: 1 token/s
    run_spec(g, 3, 1.0, 3)  # the warm-up round, then a window of 3 tokens/s: speculation wins
    run_spec(g, 1, 2.0, 1)  # window: (3 + 1) tokens in 3 s, still above 1 token/s
    run_spec(g, 1, 4.0, 1)  # (1 + 1) tokens in 6 s: below, go AR
    assert run_ar(g) == 2
    for stretch in (4, 8, 8):  # probes that fail double the stretch, up to the cap
        run_spec(g, 1, 2.0, 2)  # warm-up round after AR, then the window ...
        assert not g.ar
        run_spec(g, 1, 2.0, 1)  # ... full: 0.5 token/s
        assert run_ar(g) == stretch
    run_spec(g, 5, 1.0, 3)  # a probe that wins resets the stretch
    run_spec(g, 1, 9.0, 1)  # (5 + 1) tokens in 10 s
    assert run_ar(g) == 2
    assert g.counts == {"speculative": 18, "ar": 24, "lean": 0}


def test_probes_decide_early_and_a_lost_request_carries_over():
    g = Guard(GuardConfig(window=4, ar_steps=2, max_ar_steps=8), ar_step_s=1.0)  # AR: 1 token/s
    run_spec(g, 1, 3.0, 4)  # at the start of a request, warm-up then three bad rounds do not decide ...
    assert not g.ar
    run_spec(g, 1, 3.0, 1)  # ... the full window does (0.33 token/s): go AR
    assert run_ar(g) == 2
    run_spec(g, 1, 1.6, 3)  # in a probe, warm-up then two rounds well under the AR rate (0.62x) decide
    assert run_ar(g) == 4
    g.begin()  # the request lost as a whole: the next one starts with the next stretch
    assert run_ar(g) == 8
    g.begin()  # one decoded all in AR keeps that verdict, and its stretch ended: the probe is due now
    assert not g.ar
    run_spec(g, 1, 3.0, 3)  # it fails (warm-up, then two rounds at a third of the AR rate): 8 AR steps owed
    for left in (5, 2):  # requests of 3 tokens carry on what is left of the stretch, they do not restart it
        for _ in range(3):
            assert g.ar
            g.record(1, 1.0)
        g.begin()
        assert g.ar_left == left
    assert run_ar(g) == 2
    run_spec(g, 9, 1.0, 5)  # a probe that wins (a full window at 9 tokens/s) resets it
    assert not g.ar
    g.begin()  # and a request that won as a whole lets the next one speculate first
    assert not g.ar


def test_a_probe_near_the_ar_rate_runs_its_full_window():
    g = Guard(GuardConfig(window=4, ar_steps=2, max_ar_steps=8), ar_step_s=1.0)  # AR: 1 token/s
    run_spec(g, 1, 3.0, 5)  # warm-up and a full window at a third of the AR rate: go AR
    assert run_ar(g) == 2
    run_spec(g, 1, 1.2, 3)  # a probe at 0.83x the AR rate: two rounds do not decide it ...
    assert not g.ar
    run_spec(g, 2, 1.0, 2)  # ... the window does: (1 + 1 + 2 + 2) tokens in 4.4 s beats AR
    assert not g.ar and g.stretch == 2


def test_policy_measures_ar_when_it_has_no_figure():
    g = Guard(GuardConfig(window=2, ar_steps=3))
    assert g.ar_step_s is None
    run_spec(g, 9, 1.0, 3)  # however fast, there is nothing to compare with: measure
    assert run_ar(g, 0.5) == 3 and g.ar_step_s == 0.5
    run_spec(g, 9, 1.0, 4)  # 9 tokens/s beats 2: no switch
    g.begin()  # a new request keeps the estimate
    assert g.ar_step_s == 0.5 and g.counts == {"speculative": 0, "ar": 0, "lean": 0}


def test_ar_estimate_is_a_running_median():
    g = Guard(GuardConfig(window=1, ar_steps=4), ar_step_s=10.0)
    run_spec(g, 1, 100.0, 2)
    assert run_ar(g, 1.0) == 4
    assert g.ar_step_s == 1.0  # median of [10, 1, 1, 1, 1]


def test_the_lean_rung_comes_before_ar_and_gives_the_tree_back_when_it_wins():
    g = Guard(GuardConfig(window=2, ar_steps=2, max_ar_steps=8, lean_rounds=4), ar_step_s=1.0, has_lean=True)
    run_spec(g, 1, 2.0, 3)  # warm-up, then a window of the tree at 0.5 token/s: below AR, the lean rung first
    assert g.lean and not g.ar
    run_spec(g, 3, 1.0, 4)  # the lean rung beats AR (3 tokens/s) for its stretch of 4 rounds ...
    assert not g.lean and g.tree_probe  # ... then the tree is probed again
    run_spec(g, 4, 2.0, 2)  # 2 tokens/s: below the lean rung's 3, back to it for twice as long
    assert g.lean and g.lean_left == 8
    run_spec(g, 3, 1.0, 8)
    assert not g.lean and g.tree_probe
    run_spec(g, 8, 2.0, 2)  # 4 tokens/s: the tree wins, and the lean stretch resets
    assert not g.lean and not g.tree_probe and g.lean_stretch == 4
    run_spec(g, 1, 2.0, 2)  # the tree loses to AR: the lean rung ...
    assert g.lean
    run_spec(g, 1, 2.0, 2)  # ... loses too: AR
    assert g.ar and run_ar(g) == 2
    run_spec(g, 1, 4.0, 3)  # the probe after AR drafts lean; two rounds far below AR decide early
    assert g.ar and run_ar(g) == 4
    run_spec(g, 2, 1.0, 3)  # a lean probe that wins (2 tokens/s) stays lean ...
    assert g.lean and not g.ar and g.lean_left == 1
    run_spec(g, 2, 1.0, 2)  # ... until its stretch is over and its window won: then the tree again
    assert not g.lean and g.tree_probe
    assert g.counts == {"speculative": 31, "ar": 6, "lean": 21}
    # without a lean tree (or with the rung off) a losing tree goes straight to AR
    for g in (
        Guard(GuardConfig(window=2), ar_step_s=1.0),
        Guard(GuardConfig(window=2, lean=False), 1.0, has_lean=True),
    ):
        run_spec(g, 1, 2.0, 3)
        assert g.ar and not g.lean


def test_margin_and_disabled():
    g = Guard(GuardConfig(window=1, margin=2.0), ar_step_s=1.0)
    run_spec(g, 3, 1.0, 2)  # 3 tokens/s >= 2 x 1 token/s
    run_spec(g, 1, 0.6, 1)  # 1.67 tokens/s < 2
    assert g.ar
    g = Guard(GuardConfig(enabled=False), ar_step_s=1.0)
    run_spec(g, 1, 1e9, 50)


# -- exactness of the output --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
@pytest.mark.parametrize("head", ["full", "nanospec", "hybrid"])
@pytest.mark.parametrize("tree", ["4x2x8", LOOKUP_TREE])
def test_greedy_with_switches_equals_autoregressive(tiny_small_vocab_dir, arch, head, tree):
    dec = with_clock(make_decoder(tiny_small_vocab_dir, arch, head, tree), ALWAYS_AR)
    for prompt in prompts(3, 1):
        ar = dec.generate(prompt, 48, speculative=False)
        res = dec.generate(prompt, 48)
        assert res.tokens == ar.tokens
        check_counts(res)
        assert res.mode_rounds["ar"] > 0 and res.mode_rounds["speculative"] >= 4  # back and forth
        assert res.timers_ms["ar"] > 0


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
@pytest.mark.parametrize("head", ["full", "nanospec"])
def test_greedy_through_the_lean_rung_equals_autoregressive(tiny_small_vocab_dir, arch, head):
    """Every step one tick and a margin no round meets: each one-round window sends the tree to the lean rung
    and the lean rung to AR, so a request goes through every rung again and again; the output must not move."""
    dec = make_decoder(tiny_small_vocab_dir, arch, head, LOOKUP_TREE)
    dec.guard = Guard(GuardConfig(window=1, ar_steps=2, max_ar_steps=4, margin=1e6), clock=ticking(), has_lean=True)
    assert dec.lean_tree == TreeConfig.parse("1x0x2+lookup:8")
    lean = spec = 0
    for prompt in prompts(3, 4):
        ar = dec.generate(prompt, 48, speculative=False)
        res = dec.generate(prompt, 48)
        assert res.tokens == ar.tokens
        check_counts(res)
        assert res.mode_rounds["lean"] > 0 and res.mode_rounds["ar"] > 0
        lean, spec = lean + res.mode_rounds["lean"], spec + res.mode_rounds["speculative"]
    assert lean < spec  # tree rounds too (the first request's first window)


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_tiny_ar_figure_switches(tiny_small_vocab_dir, arch):
    """The real clock against a 1 ns AR step: speculation looks slower, so after the warm-up round and a full
    window the guard decodes autoregressively (later, its own measured AR steps set the figure)."""
    dec = make_decoder(tiny_small_vocab_dir, arch, "nanospec", LOOKUP_TREE, guard=GuardConfig(), ar_step_s=1e-9)
    for prompt in prompts(2, 2):
        res = dec.generate(prompt, 60)
        assert res.tokens == dec.generate(prompt, 60, speculative=False).tokens
        check_counts(res)
        assert res.mode_rounds["ar"] > 0


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_lost_requests_carry_the_stretch_and_only_probe(tiny_small_vocab_dir, arch):
    """Speculation always losing (every step one tick, margin 1e6): the first request speculates a full window,
    the next ones start in the AR stretch left over and speculate only in probes (a warm-up round and two that
    decide), the stretch doubling across requests instead of restarting at each."""
    dec = with_clock(make_decoder(tiny_small_vocab_dir, arch, "nanospec", LOOKUP_TREE), GuardConfig(margin=1e6))
    modes: list[bool] = []  # per step: whether it was an AR step
    record = dec.guard.record
    dec.guard.record = lambda tokens, seconds: (modes.append(dec.guard.ar), record(tokens, seconds))[1]
    probes = 0
    for i, prompt in enumerate(prompts(4, 2)):
        modes.clear()
        res = dec.generate(prompt, 60)
        assert res.tokens == dec.generate(prompt, 60, speculative=False).tokens
        check_counts(res)
        runs = [len(list(g)) for ar, g in itertools.groupby(modes) if not ar]  # consecutive speculative rounds
        if i == 0:
            assert runs[0] == GuardConfig().window + 1 and res.mode_rounds["ar"] > 0
        else:
            assert max(runs, default=0) <= 3, modes
            probes += len(runs)
    assert probes > 0 and dec.guard.stretch == GuardConfig().max_ar_steps  # probes came, and failed


def test_huge_ar_figure_never_switches(tiny_small_vocab_dir):
    guarded = make_decoder(tiny_small_vocab_dir, tree=LOOKUP_TREE, guard=GuardConfig(window=1), ar_step_s=1e9)
    plain = make_decoder(tiny_small_vocab_dir, tree=LOOKUP_TREE)
    assert plain.guard is None  # no policy: every round speculates
    for prompt in prompts(3, 3):
        a, b = guarded.generate(prompt, 40), plain.generate(prompt, 40)
        assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
        assert a.mode_rounds == b.mode_rounds == {"speculative": len(b.accept_lengths), "ar": 0, "lean": 0}


@pytest.mark.parametrize("steps", [1, 3])
def test_stop_budget_and_context_with_switches(tiny_small_vocab_dir, steps):
    """Every budget and every stop position, so that a switch lands on the last token in some of them."""
    cfg = GuardConfig(window=1, ar_steps=steps, max_ar_steps=steps, margin=1e6)
    dec = with_clock(make_decoder(tiny_small_vocab_dir, tree=LOOKUP_TREE), cfg)
    prompt = torch.tensor([1, 2, 3])
    ar = dec.generate(prompt, 30, speculative=False).tokens
    ends = set()
    for n in range(1, 31):
        res = dec.generate(prompt, n)
        assert res.tokens == ar[:n] and res.stop_reason == "max_new_tokens"
        check_counts(res)
        ends.add(dec.guard.ar_left)  # > 0: the request ended in (or right at the start of) an AR stretch
    assert len(ends) > 1
    for i, stop in enumerate(ar):
        if stop in ar[:i]:
            continue
        dec.stop_ids = {stop}
        res = dec.generate(prompt, 30)
        assert res.tokens == ar[: i + 1] and res.stop_reason == "stop_token"
        check_counts(res)
    dec.stop_ids = set()
    small = with_clock(make_decoder(tiny_small_vocab_dir, tree=LOOKUP_TREE, max_len=24), cfg)
    for plen in (10, 14, 20):
        prompt = torch.arange(plen) % 16
        res, ref = small.generate(prompt, 100), small.generate(prompt, 100, speculative=False)
        assert res.stop_reason == ref.stop_reason == "context"
        assert res.tokens == ref.tokens and len(res.tokens) == 24 - plen + 1
        check_counts(res)


class Alternating(Guard):
    """One AR step after every speculative round, whose tree alternates between the decoder's and the lean one:
    the mode changes at every point of the sequence."""

    def record(self, tokens, seconds):
        spec = not self.ar
        super().record(tokens, seconds)
        if spec:
            self.ar_left, self.lean = 1, not self.lean


def test_sampling_law_is_unchanged(tiny_small_vocab_dir):
    cfg = SamplingConfig(1.0)
    dec = make_decoder(tiny_small_vocab_dir, tree="8x1x12")
    dec.guard = Alternating(GuardConfig(enabled=False))
    prompt = torch.tensor([3, 1, 4, 1, 5])
    n = 4
    law = exact_joint(dec, prompt, cfg, n=n)
    runs = [dec.generate(prompt, n, SamplingConfig(1.0, seed=i)) for i in range(2000)]
    for r in runs:
        check_counts(r)
    after_ar = sum(r.mode_rounds["ar"] > 0 and r.mode_rounds["speculative"] > 1 for r in runs)
    assert 200 < after_ar  # speculation after AR steps (the drafter's catch-up) happens often
    assert 200 < sum(max(r.accept_lengths) > 1 for r in runs) < 1800  # drafts accepted and rejected
    samples = [r.tokens for r in runs]
    for positions in ([1], [2], [3], [1, 2], [2, 3], list(range(n))):
        assert chi2_pvalue(samples, law, positions) > 1e-3, positions
    wrong = exact_joint(dec, prompt, SamplingConfig(1.3), n=n)
    assert chi2_pvalue(samples, wrong, list(range(n))) < 1e-3
