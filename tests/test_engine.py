"""Losslessness of speculative decoding on tiny random targets: greedy token-for-token, sampling in law."""

import pytest
import torch
from scipy.stats import chisquare

from spechead import kernels
from spechead.decoding.decoder import Decoder
from spechead.decoding.sampling import SamplingConfig, greedy, target_probs
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.full import FullHead
from spechead.model.drafter import random_drafter
from spechead.model.layers import Segment
from spechead.model.loading import load_target

TREES = [
    TreeConfig(4, 4, 16),
    TreeConfig(2, 3, 8),
    TreeConfig(3, 2, 10),
    TreeConfig.chain(4),
    TreeConfig(4, 0, 4),
    TreeConfig(2, 3, 8, lookup=5),
    TreeConfig.parse("chain:2+lookup-first"),
]


def make_decoder(folder, arch="eagle2", tree=TREES[0], max_len=256, stop_ids=None, seed=0):
    target, _ = load_target(str(folder))
    drafter = random_drafter(target, arch, seed=seed)
    w, ids = drafter.head_weight(target)
    return Decoder(target, drafter, FullHead(w, ids, target.config.vocab_size), tree, max_len, stop_ids)


@pytest.mark.paths
@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
@pytest.mark.parametrize("tree", TREES, ids=str)
def test_greedy_equals_autoregressive(tiny_small_vocab_dir, arch, tree):
    dec = make_decoder(tiny_small_vocab_dir, arch, tree)
    g = torch.Generator().manual_seed(3)
    longest = 0
    for _ in range(5):
        prompt = torch.randint(0, 16, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g)
        ar = dec.generate(prompt, 40, speculative=False)
        spec = dec.generate(prompt, 40)
        assert spec.tokens == ar.tokens
        assert sum(spec.accept_lengths) + 1 == len(spec.tokens)  # prefill emits the first token
        longest = max(longest, max(spec.accept_lengths))
    if tree.total_tokens > 4:
        assert longest >= 3 if arch == "eagle2" else 2  # multi-token acceptance + cache compaction happened


def test_lookup_branch_is_used_and_lossless(tiny_small_vocab_dir):
    """A depth-0 tree commits at most 2 tokens a round; longer rounds come from the lookup branch."""
    dec = make_decoder(tiny_small_vocab_dir, tree=TreeConfig(2, 0, 3, lookup=6), max_len=96)
    plain = make_decoder(tiny_small_vocab_dir, tree=TreeConfig(2, 0, 3), max_len=96)
    g = torch.Generator().manual_seed(5)
    longest = 0
    for _ in range(4):
        prompt = torch.randint(0, 16, (12,), generator=g)
        ar = dec.generate(prompt, 60, speculative=False)
        spec = dec.generate(prompt, 60)
        assert spec.tokens == ar.tokens
        assert max(plain.generate(prompt, 60).accept_lengths) <= 2
        longest = max(longest, max(spec.accept_lengths))
    assert longest > 2
    # near the context limit the branch is clipped to the room left, and the output still matches
    prompt = torch.randint(0, 16, (80,), generator=g)
    assert dec.generate(prompt, 40).tokens == dec.generate(prompt, 40, speculative=False).tokens


def test_lookup_first_drafts_the_lookups_tokens_in_the_chains_rows(tiny_small_vocab_dir):
    """``chain:N+lookup-first`` (how vLLM's one chain takes the lookup): where the context repeats, the chain's
    tokens are the lookup's, so it accepts what the drafter alone does not, with no more rows, and stays lossless."""
    first = make_decoder(tiny_small_vocab_dir, tree=TreeConfig.parse("chain:1+lookup-first"), max_len=128)
    plain = make_decoder(tiny_small_vocab_dir, tree=TreeConfig.chain(1), max_len=128)
    g = torch.Generator().manual_seed(5)
    gained = 0
    for _ in range(4):
        prompt = torch.randint(0, 16, (12,), generator=g)
        ar = first.generate(prompt, 60, speculative=False).tokens
        prompt = torch.cat([prompt, torch.tensor(ar), prompt])  # the target's own run follows the prompt again
        want = first.generate(prompt, 40, speculative=False).tokens
        spec, base = first.generate(prompt, 40), plain.generate(prompt, 40)
        assert spec.tokens == want == base.tokens and max(spec.accept_lengths) <= 2
        gained += len(spec.accept_lengths) < len(base.accept_lengths)  # the same tokens in fewer rounds
    assert gained >= 3


@pytest.mark.paths
def test_trees_beyond_16_rows_stay_on_the_kernel(tiny_small_vocab_dir):
    """A 24-row tree's verification products are bitwise those of decode steps, row by row (the kernel's per-row
    results do not depend on the row count)."""
    if not kernels.available():
        pytest.skip("spechead's kernel is not built on this machine")
    target = make_decoder(tiny_small_vocab_dir, tree=TreeConfig(4, 4, 16, lookup=8)).target
    x = torch.randn(24, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for m in (target.lm_head, target.model.layers[0].mlp.gate_up_proj):
            assert torch.equal(m(x), torch.cat([m(x[i : i + 1]) for i in range(24)]))


@pytest.mark.paths
@pytest.mark.parametrize("folder", ["tiny_dir", "tiny_gemma3_dir"])
@pytest.mark.parametrize("start", [40, 254])
def test_fused_layers_are_the_modules_and_verification_rows_are_decode_steps(folder, start, request):
    """The one-op decoder layers compute what the modules do, bitwise, for a Llama and a Gemma 3 target (q / k
    norms, sandwich norms, GELU, sliding windows past their width); and a tree verification's row is bitwise the
    decode step it stands for (projections, attention and MLP all computing a row on its own), also where the
    tree's slots straddle the attention's chunk boundary at 256 and its decode steps' do not."""
    if not kernels.available():
        pytest.skip("spechead's kernel is not built on this machine")
    target = make_decoder(request.getfixturevalue(folder), tree=TREES[0], max_len=320).target
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, target.config.vocab_size, (start + 4,), generator=g)
    # a tree of 4 nodes: 0 -> 1 -> 3 is a branch, 2 a sibling of 1
    depth = torch.tensor([0, 1, 1, 2])
    mask = torch.ones(4, start + 4, dtype=torch.bool)
    mask[:, start:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    runs = {}
    with torch.inference_mode():
        for fused in (True, False):
            target(ids[:start], 0, logits_rows=None)
            target._fused = None if fused else ()  # () keeps the modules
            rope = target.rotary(depth[:1])
            x = target.model.embed_tokens(ids[:1])
            assert (target._fused_layers(x, [Segment(0, 1, 0)], rope, [], None) is not None) == fused
            tree = target(ids[start:], start, positions=start + depth, mask=mask).logits
            for branch in ([0, 1, 3], [0, 2]):
                steps = [target(ids[start + i : start + i + 1], start + n).logits[0] for n, i in enumerate(branch)]
                assert torch.equal(torch.stack(steps), tree[branch]), branch
            runs[fused] = tree
            target._fused = None
    assert torch.equal(runs[True], runs[False])


@pytest.mark.paths
def test_eagle3_on_deeper_target(tiny_dir):
    dec = make_decoder(tiny_dir, "eagle3", TreeConfig(4, 3, 12))
    prompt = torch.arange(10) % 64
    assert dec.generate(prompt, 30).tokens == dec.generate(prompt, 30, speculative=False).tokens


def test_stop_tokens_and_budget(tiny_small_vocab_dir):
    dec = make_decoder(tiny_small_vocab_dir)
    prompt = torch.tensor([1, 2, 3])
    ar = dec.generate(prompt, 30, speculative=False).tokens
    stop = ar[5]
    dec.stop_ids = {stop}
    for spec in (False, True):
        res = dec.generate(prompt, 30, speculative=spec)
        assert res.tokens == ar[: ar.index(stop) + 1] and res.stop_reason == "stop_token"
    dec.stop_ids = set()
    for n in (1, 2, 7):
        assert dec.generate(prompt, n).tokens == ar[:n]


def test_context_limit(tiny_small_vocab_dir):
    dec = make_decoder(tiny_small_vocab_dir, max_len=24)
    prompt = torch.arange(10) % 16
    ar = dec.generate(prompt, 100, speculative=False)
    spec = dec.generate(prompt, 100)
    assert ar.stop_reason == spec.stop_reason == "context"
    assert spec.tokens == ar.tokens and len(ar.tokens) == 24 - 10 + 1


def test_bad_prompts(tiny_small_vocab_dir):
    dec = make_decoder(tiny_small_vocab_dir, max_len=24)
    with pytest.raises(SpecheadError, match="empty"):
        dec.generate([], 4)
    with pytest.raises(SpecheadError, match="does not fit"):
        dec.generate(list(range(16)) * 2, 4)
    with pytest.raises(SpecheadError, match="outside the vocabulary"):
        dec.generate([99], 4)


def exact_joint(dec, prompt, cfg, n=3):
    """Exact law of the first n sampled tokens, by enumerating the target's conditionals."""
    target, V = dec.target, dec.target.config.vocab_size
    probs = {(): 1.0}
    with torch.inference_mode():
        for _ in range(n):
            nxt = {}
            for prefix, p in probs.items():
                ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])
                q = target_probs(target(ids, 0, logits_rows=slice(-1, None)).logits[-1], cfg)
                for t in range(V):
                    if q[t] > 0:
                        nxt[prefix + (t,)] = p * float(q[t])
            probs = nxt
    return probs


def chi2_pvalue(samples, law, positions):
    """Chi-square test of the empirical law of tokens at `positions` against the exact one (small cells pooled)."""
    exp, obs = {}, {}
    for seq, p in law.items():
        key = tuple(seq[i] for i in positions)
        exp[key] = exp.get(key, 0.0) + p
    for s in samples:
        key = tuple(s[i] for i in positions)
        obs[key] = obs.get(key, 0) + 1
    n = len(samples)
    big = [k for k in exp if exp[k] * n >= 5]
    o = [obs.get(k, 0) for k in big] + [n - sum(obs.get(k, 0) for k in big)]
    e = [exp[k] * n for k in big] + [n - sum(exp[k] * n for k in big)]
    return chisquare(o, e).pvalue


@pytest.mark.paths
def test_greedy_is_argmax_with_the_lowest_index_among_ties():
    """The target's greedy token (the kernels' one-pass top-1 where they run): argmax's row by row, vocabulary-wide
    rows and a row of one, the lowest index where maxima tie, a 1-D row as one."""
    g = torch.Generator().manual_seed(0)
    for V in (1, 7, 49152, 262144):
        x = torch.randn(5, V, generator=g)
        assert greedy(x) == x.argmax(-1).tolist() and greedy(x[3]) == [int(x[3].argmax())]
    x = torch.zeros(3, 1000)
    x[0, [5, 700]] = 2.0  # a tie: the first
    x[1, 999] = 1.0
    x[2] = -torch.inf  # every value -inf: the first
    assert greedy(x) == [5, 999, 0] == x.argmax(-1).tolist()
    assert greedy(x[:, ::2]) == x[:, ::2].argmax(-1).tolist()  # a strided view


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(1.0),  # every path: the draft head's probabilities as that path computes them
        SamplingConfig(1.5, top_p=0.95, top_k=10),  # + the filters' rule
    ],
    ids=["t1", "topp-topk"],
)
def test_sampling_matches_target_distribution(tiny_small_vocab_dir, cfg):
    """Several candidates per node (8 of 16 tokens): accepted and rejected drafts both occur."""
    dec = make_decoder(tiny_small_vocab_dir, tree=TreeConfig(8, 1, 12))
    prompt = torch.tensor([3, 1, 4, 1, 5])
    law = exact_joint(dec, prompt, cfg)
    runs = [dec.generate(prompt, 3, SamplingConfig(cfg.temperature, cfg.top_p, cfg.top_k, seed=i)) for i in range(2000)]
    samples = [r.tokens for r in runs]
    multi = sum(max(r.accept_lengths) > 1 for r in runs)
    assert 200 < multi < 1800  # drafts are accepted and rejected, so the rejection rule is exercised
    for positions in ([1], [2], [1, 2], [0, 1, 2]):
        assert chi2_pvalue(samples, law, positions) > 1e-3, positions
    # the test has power: the same samples are rejected against a slightly different law
    wrong = exact_joint(dec, prompt, SamplingConfig(cfg.temperature * 1.3, cfg.top_p, cfg.top_k))
    assert chi2_pvalue(samples, wrong, [0, 1, 2]) < 1e-3


def test_sampling_with_lookup_matches_target_distribution(tiny_small_vocab_dir):
    """Lookup tokens are point-mass drafts like any other: the law of the output is the target's.

    The prompt ends in the target's own greedy run, so the lookup branch is accepted in most rounds
    and rejected in the rest; a depth-0 tree alone commits at most 2 tokens a round."""
    cfg = SamplingConfig(1.0)
    dec = make_decoder(tiny_small_vocab_dir, tree=TreeConfig(2, 0, 3, lookup=3))
    p0 = [1, 2]
    prompt = torch.tensor(p0 + dec.generate(torch.tensor(p0), 12, speculative=False).tokens)
    law = exact_joint(dec, prompt, cfg, n=4)
    runs = [dec.generate(prompt, 4, SamplingConfig(1.0, seed=i)) for i in range(2000)]
    extended = sum(max(r.accept_lengths) > 2 for r in runs)
    assert 200 < extended < 1800, extended
    samples = [r.tokens for r in runs]
    for positions in ([1], [2], [3], [1, 2, 3], [0, 1, 2, 3]):
        assert chi2_pvalue(samples, law, positions) > 1e-3, positions
    wrong = exact_joint(dec, prompt, SamplingConfig(1.3), n=4)
    assert chi2_pvalue(samples, wrong, [0, 1, 2, 3]) < 1e-3


def test_sampling_is_reproducible_with_seed(tiny_small_vocab_dir):
    dec = make_decoder(tiny_small_vocab_dir)
    cfg = SamplingConfig(1.0, seed=123)
    assert dec.generate([1, 2], 20, cfg).tokens == dec.generate([1, 2], 20, cfg).tokens


@pytest.mark.paths
@pytest.mark.parametrize("tree", TREES, ids=str)
def test_sampled_speculative_output_is_ars_for_the_same_seed(tiny_small_vocab_dir, tree):
    """The draw at a position depends on the seed and the position only, so a seeded sampled request gives AR's
    text token for token whatever the tree (drafts accepted and rejected alike), as greedy decoding does."""
    dec = make_decoder(tiny_small_vocab_dir, tree=tree)
    rounds = []
    for seed in range(6):
        cfg = SamplingConfig(1.0, top_p=0.95, seed=seed)
        ar = dec.generate([1, 2], 24, cfg, speculative=False).tokens
        res = dec.generate([1, 2], 24, cfg)
        assert res.tokens == ar, seed
        rounds += res.accept_lengths
    assert max(rounds) > 1 and min(rounds) == 1  # drafts were both accepted and rejected


def test_a_temperature_near_zero_samples_the_argmax(tiny_small_vocab_dir):
    """Dividing the logits first overflowed to inf - inf (and a temperature rounding to 0 in float32 to 0 / 0): the
    sample failed; the limit is the argmax's point mass."""
    dec = make_decoder(tiny_small_vocab_dir)
    greedy = dec.generate([1, 2], 12, speculative=False).tokens
    for t in (1e-45, 1e-300):
        assert dec.generate([1, 2], 12, SamplingConfig(t, seed=1)).tokens == greedy


def test_draws_never_share_noise_within_a_request_and_refuse_nan_logits():
    """torch's CPU generator keeps 32 bits of a seed: positions' seeds are a bijection of base + position, so no two
    positions of a request share their noise (hashed 64-bit seeds collided in their low words: seed 0 at positions
    7,679 and 200,073); NaN logits are an error, not token 0."""
    from spechead.decoding.sampling import Draws

    for seed in (0, 1, 2**63 - 1):
        d = Draws(seed, SamplingConfig(1.0))
        assert len({d.seed_at(t) for t in range(250_000)}) == 250_000
    with pytest.raises(RuntimeError, match="not finite"):
        Draws(0, SamplingConfig(1.0)).token(torch.full((8,), float("nan")), 0)
