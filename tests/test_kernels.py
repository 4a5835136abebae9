"""The draft-GEMM kernel and its blocked weight layout: same products as F.linear, in-place row writes."""

import pytest
import torch
import torch.nn.functional as F

from spechead import kernels
from spechead.kernels import BlockedWeight

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"kernel unavailable: {kernels.unavailable_reason()}")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), w.double()).float()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 64), (160, 576), (48, 4096), (21, 2)])
def test_kernel_matches_linear_for_every_row_count(dtype, shape):
    """1-16 rows go to one kernel call (a template per row count), more are chunked; N need not be a multiple
    of 16. fp32 accumulation in a different order than F.linear: equal to ~1e-6 relative."""
    g = torch.Generator().manual_seed(0)
    n, k = shape
    w = torch.randn(n, k, generator=g).to(dtype)
    bw = BlockedWeight(w)
    assert bw.blocked and bw.shape == (n, k)
    for m in [*range(1, 17), 23, 40]:
        x = torch.randn(m, k, generator=g).to(dtype)
        got = bw(x)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got, reference(x, w), rtol=1e-5, atol=1e-5 * k**0.5)
    assert torch.equal(bw.read(), w)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_written_in_place_and_prefix_calls(dtype):
    """NanoSpec's use: a buffer with spare capacity, rows rewritten in any slots, calls over the first n rows."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 96, generator=g).to(dtype)
    bw = BlockedWeight(w[:20], capacity=50)
    plain = torch.zeros(50, 96, dtype=dtype)
    plain[:20] = w[:20]
    slots = torch.tensor([49, 3, 20, 33, 17])
    bw.write(slots, w[slots])
    plain[slots] = w[slots]
    assert torch.equal(bw.read(50), plain)
    x = torch.randn(10, 96, generator=g).to(dtype)
    for n in (1, 16, 17, 34, 50):
        torch.testing.assert_close(bw(x, n), reference(x, plain[:n]), rtol=1e-5, atol=1e-4)


def test_fallback_without_the_kernel_gives_the_same_products(monkeypatch):
    """Where the kernel cannot run (no AVX-512, no compiler, CUDA), the plain layout and F.linear serve."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g)
    monkeypatch.setattr(kernels, "supports", lambda weight: False)
    bw = BlockedWeight(w[:30], capacity=40)
    assert not bw.blocked
    bw.write(torch.tensor([35, 2]), w[torch.tensor([35, 2])])
    plain = torch.zeros(40, 64)
    plain[:30] = w[:30]
    plain[torch.tensor([35, 2])] = w[torch.tensor([35, 2])]
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(bw(x, 40), reference(x, plain), rtol=1e-5, atol=1e-5)
    assert torch.equal(bw.read(40), plain)


@needs_kernel
def test_kernel_rejects_bad_shapes():
    bw = BlockedWeight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="columns"):
        torch.ops.spechead.draft_linear(torch.randn(2, 63), bw.data, 2)
    with pytest.raises(RuntimeError, match="blocks out of range"):
        torch.ops.spechead.draft_linear(torch.randn(2, 64), bw.data, 3)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [5, 37, 3072, 49152])
def test_row_topk_values_indices_and_log_softmax(dtype, V):
    """Top-k values equal torch.topk's (indices may differ only among ties), the fused log-softmax equals
    log_softmax at those indices, an index map is applied, and -inf entries are handled."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, V, generator=g) * 4).to(dtype)
    x[0, : V // 2] = float("-inf")
    x[1] = x[1, 0]  # a row of ties
    k = min(10, V)
    vals, idx = torch.ops.spechead.row_topk(x, k)
    ref = x.float().topk(k, dim=-1)
    assert torch.equal(vals, ref.values)
    assert torch.equal(x.float().gather(1, idx), ref.values)
    assert torch.equal(idx[1], torch.arange(k))  # ties: the lower index first
    logp, idx2 = torch.ops.spechead.row_topk(x, k, True)
    assert torch.equal(idx2, idx)
    torch.testing.assert_close(logp, x.float().log_softmax(-1).gather(1, idx), rtol=0, atol=2e-6)
    ids = torch.randperm(V, generator=g)
    _, mapped = torch.ops.spechead.row_topk(x, k, False, ids)
    assert torch.equal(mapped, ids[idx])
    with pytest.raises(RuntimeError, match="index_map"):
        torch.ops.spechead.row_topk(x, k, False, ids[:-1])


@needs_kernel
def test_row_topk_worst_case_order_is_still_exact():
    """Ascending rows make every element beat the current k-th best: the slow path, still exact."""
    x = torch.arange(5000.0).repeat(3, 1)
    vals, idx = torch.ops.spechead.row_topk(x, 8)
    assert torch.equal(idx, torch.arange(4999, 4991, -1).repeat(3, 1)) and torch.equal(vals, idx.float())


@needs_kernel
def test_row_topk_ranks_nan_lowest():
    x = torch.tensor([[float("nan"), 1.0, float("nan"), 3.0, 2.0, 0.5]])
    vals, idx = torch.ops.spechead.row_topk(x, 3)
    assert idx.tolist() == [[3, 4, 1]] and vals.tolist() == [[3.0, 2.0, 1.0]]
