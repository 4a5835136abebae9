"""SlimSpec low-rank head: SVD factors against the Eckart-Young bounds, the module, the head, losslessness."""

import pytest
import torch

from spechead import kernels
from spechead.decoding.decoder import Decoder
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.base import fast_topk, make_head, topk_logprobs
from spechead.heads.lowrank import LowRankHead, LowRankScorer
from spechead.heads.tokenmaps import save_token_map
from spechead.kernels.linear import PackedLinear, Projection
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target
from spechead.model.lowrank import LowRankLinear, svd_factors, truncate_factors


def weight_with_spectrum(V=96, d=32, seed=0):
    """A head with a decaying spectrum, like real LM heads (so truncation errors are not all alike)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(V, d, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    s = torch.logspace(1, -2, d, dtype=torch.float64)
    return (u * s) @ v.T, s


@pytest.mark.parametrize("r", [1, 4, 16, 31])
def test_svd_factors_meet_the_truncation_bounds(r):
    W, s = weight_with_spectrum()
    up, down = svd_factors(W, r)
    assert up.shape == (96, r) and down.shape == (r, 32)
    # Eckart-Young: the Frobenius error is exactly the discarded singular values' energy
    err = torch.linalg.matrix_norm(W - up @ down)
    torch.testing.assert_close(err, s[r:].pow(2).sum().sqrt(), rtol=1e-6, atol=1e-9)
    # and no state's logits move by more than sigma_{r+1} |h| (the spectral-norm bound)
    h = torch.randn(200, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dev = (h @ W.T - (h @ down.T) @ up.T).norm(dim=-1)
    assert bool((dev <= s[r] * h.norm(dim=-1) * (1 + 1e-9)).all())
    # the two factors carry S^1/2 each
    torch.testing.assert_close(up.norm(dim=0), s[:r].sqrt(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(down.norm(dim=1), s[:r].sqrt(), rtol=1e-6, atol=1e-9)


def test_fp32_head_at_a_realistic_aspect_ratio():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(2048, 64, generator=g) * 0.02
    s = torch.linalg.svdvals(W.double())
    up, down = svd_factors(W, 8)
    assert up.dtype == down.dtype == torch.float32
    err = torch.linalg.matrix_norm((W - up @ down).double())
    torch.testing.assert_close(err, s[8:].pow(2).sum().sqrt(), rtol=1e-4, atol=0)


def test_low_rank_linear_module_layout_and_init():
    W, _ = weight_with_spectrum()
    W = W.float()
    m = LowRankLinear.from_svd(W, 6)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == {"down.weight": (6, 32), "up.weight": (96, 6)}
    assert (m.rank, m.in_features, m.out_features) == (6, 32, 96)
    x = torch.randn(3, 32)
    torch.testing.assert_close(m(x), x @ m.dense().T, rtol=1e-5, atol=1e-5)
    up, down = svd_factors(W, 6)
    torch.testing.assert_close(m.dense(), up @ down)
    # a random init gives logits with the variance of a std-0.02 full head
    big = LowRankLinear.from_random(256, 4096, 32, generator=torch.Generator().manual_seed(0))
    h = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ratio = big(h).var() / (h @ (torch.randn(4096, 256) * 0.02).T).var()
    assert 0.8 < float(ratio) < 1.25
    assert LowRankLinear.from_random(32, 96, 4, dtype=torch.bfloat16).up.weight.dtype == torch.bfloat16


def test_truncating_a_factorisation_equals_truncating_its_product():
    W, _ = weight_with_spectrum(seed=3)
    up, down = svd_factors(W, 12)
    mixed = torch.randn(12, 12, dtype=torch.float64)  # any other factorisation of the same product
    up2, down2 = truncate_factors(up @ mixed, torch.linalg.solve(mixed, down), 5)
    ref_up, ref_down = svd_factors(up @ down, 5)
    torch.testing.assert_close(up2 @ down2, ref_up @ ref_down, rtol=1e-8, atol=1e-10)
    with pytest.raises(SpecheadError, match="cannot raise"):
        truncate_factors(up, down, 13)


def test_head_topk_equals_brute_force_over_the_full_vocabulary():
    W, _ = weight_with_spectrum(seed=4)
    W = W.float()
    head = make_head("lowrank:8", W, None, 96)
    assert isinstance(head, LowRankHead) and head.stats()["rank"] == 8
    up, down = svd_factors(W, 8)
    h = torch.randn(5, 32)
    logp, ids = head.topk(h, 7)
    want_logp, want = (h @ (up @ down).T).log_softmax(-1).topk(7, dim=-1)
    assert torch.equal(ids, want)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    assert make_head("lowrank", W, None, 96).scorer.rank == 4  # d/8


def test_head_uses_a_drafters_own_low_rank_head_and_maps_reduced_rows():
    m = LowRankLinear.from_random(32, 40, 6, generator=torch.Generator().manual_seed(5))
    row_ids = torch.randperm(96, generator=torch.Generator().manual_seed(6))[:40].sort().values
    head = LowRankHead(m, row_ids, 96)
    h = torch.randn(4, 32)
    logp, ids = head.topk(h, 5)
    want_logp, rows = m(h).log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(ids, row_ids[rows])
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    assert LowRankHead(m, row_ids, 96, rank=3).scorer.rank == 3  # re-truncated, not re-trained


def test_scorer_scores_every_row_with_its_factors():
    m = LowRankLinear.from_random(32, 96, 8, generator=torch.Generator().manual_seed(7))
    scorer = LowRankScorer.from_weight(m)
    h = torch.randn(3, 32)
    torch.testing.assert_close(scorer.logits(h), m(h), rtol=1e-5, atol=1e-5)
    assert scorer.rank == 8 and scorer.nbytes == (96 * 8 + 8 * 32) * 4


def test_bad_ranks():
    W = torch.randn(96, 32)
    for spec, match in [
        ("lowrank:32", "below the hidden size 32"),
        ("lowrank:40", "below"),
        ("lowrank:0", r"\[1, 31\]"),
    ]:
        with pytest.raises(SpecheadError, match=match):
            make_head(spec, W, None, 96)
    with pytest.raises(SpecheadError, match="integer rank"):
        make_head("lowrank:big", W, None, 96)
    with pytest.raises(SpecheadError, match="below the hidden size"):
        LowRankLinear(32, 96, 32)
    with pytest.raises(SpecheadError, match="below the hidden size"):
        svd_factors(W, 33)


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_greedy_output_equals_autoregressive(tiny_small_vocab_dir, arch):
    target, _ = load_target(str(tiny_small_vocab_dir))
    drafter = random_drafter(target, arch, seed=2)
    weight, row_ids = drafter.head_weight(target)
    ar = Decoder(target, max_len=128)
    prompts = ([1, 2, 3], [9, 4, 4, 7, 0, 15, 2])
    want = [ar.generate(p, 30, speculative=False).tokens for p in prompts]
    for spec in ("lowrank", "lowrank:2"):
        dec = Decoder(target, drafter, make_head(spec, weight, row_ids, 16), TreeConfig(4, 3, 12), 128)
        got = [dec.generate(p, 30) for p in prompts]
        assert [r.tokens for r in got] == want
        assert max(max(r.accept_lengths) for r in got) >= 2


@pytest.mark.parametrize("V, k", [(128 * 40, 10), (128 * 40, 1), (128 * 5, 5), (1000, 10), (128 * 3, 4)])
def test_fast_topk_is_exact(V, k):
    g = torch.Generator().manual_seed(V + k)
    x = torch.randn(6, V, generator=g)
    x[0, :256] = 5.0  # the best values crowded into two chunks
    x[1, ::128] = 4.0  # one per chunk
    vals, idx = fast_topk(x, k)
    want = x.topk(k, dim=-1)
    assert torch.equal(vals, want.values)
    assert torch.equal(x.gather(1, idx), vals)  # indices point at those values (ties may pick others)
    assert torch.equal(idx[2:], want.indices[2:])  # distinct values: the same indices
    logp, i2 = topk_logprobs(x, k)
    torch.testing.assert_close(logp, x.log_softmax(-1).gather(1, i2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_linear_and_heads_use_it(dtype, tmp_path):
    g = torch.Generator().manual_seed(8)
    W = (torch.randn(4096, 64, generator=g) * 0.02).to(dtype)  # big enough to be packed
    x = torch.randn(7, 64, generator=g).to(dtype)
    lin = PackedLinear(W)
    # the kernel's layout wherever a build runs here (one copy of W), F.linear on the plain weight elsewhere
    assert lin.kind == ("kernel" if kernels.available() else "linear")
    assert (lin.weight is None) == kernels.available()
    out = lin(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.nn.functional.linear(x, W).float(), rtol=1e-2, atol=1e-3)
    assert lin.nbytes == W.numel() * W.element_size() and lin.shape == W.shape
    # the heads' results through the packed path still equal brute force over their candidate set
    up, down = svd_factors(W.float(), 16)
    head = LowRankHead(W.float(), None, 4096, rank=16)
    h = torch.randn(3, 64, generator=g)
    logp, ids = head.topk(h, 5)
    want_logp, want = (h @ (up @ down).T).log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(ids, want)
    torch.testing.assert_close(logp, want_logp, rtol=1e-4, atol=1e-4)
    keep = torch.randperm(4096, generator=g)[:2048]
    sub = make_head(f"fr:{save_token_map(keep.tolist(), tmp_path / 'l.pt')}", W.float(), None, 4096)
    logp, ids = sub.topk(h, 5)
    want_logp, pos = (h @ W.float()[keep].T).log_softmax(-1).topk(5, dim=-1)
    assert torch.equal(ids, keep[pos])
    torch.testing.assert_close(logp, want_logp, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not kernels.available(), reason="no kernel build on this machine: nothing laid out to share")
def test_tied_full_head_shares_the_targets_layout_and_a_changed_weight_gets_a_new_one():
    g = torch.Generator().manual_seed(9)
    W = torch.nn.Parameter(torch.randn(4096, 64, generator=g) * 0.02, requires_grad=False)
    linear = torch.nn.Linear(64, 4096, bias=False)
    linear.weight = W
    laid_out = Projection(linear).layout  # a target's tied LM head, laid out as prepack does
    head = make_head("full", W, None, 4096)
    assert head.lin.blocked is laid_out and head.extra_bytes() == 0  # one copy of W
    h = torch.randn(3, 64, generator=g)
    private = PackedLinear(W.detach().clone())  # another tensor: its own layout, the same arithmetic
    assert private.blocked is not laid_out and not private.shares_layout
    assert torch.equal(head.lin(h), private(h))
    with torch.no_grad():
        W.mul_(2.0)  # changed in place (a head being trained): the old layout must not serve it
    again = PackedLinear(W)
    assert again.blocked is not laid_out and not again.shares_layout
    torch.testing.assert_close(again(h), torch.nn.functional.linear(h, W), rtol=1e-4, atol=1e-5)
    with torch.inference_mode():  # an inference tensor keeps no version counter: laid out, never shared
        Wi = torch.randn(4096, 64, generator=g)
        first, second = PackedLinear(Wi), PackedLinear(Wi)
        assert first.blocked is not second.blocked and torch.equal(first(h), second(h))
