"""The CPU kernels, every build this CPU runs (avx512, avx2, generic) in one process: the same products as
F.linear for every row count, bitwise independent of the row count, in-place row writes, exact row top-k."""

import pytest
import torch
import torch.nn.functional as F

from spechead import kernels
from spechead.kernels import LANES
from spechead.kernels.linear import BlockedWeight

pytestmark = pytest.mark.paths  # every test here checks a kernel path

needs_kernel = pytest.mark.skipif(not kernels.available(), reason=f"no kernels: {kernels.unavailable_reason()}")


def _runnable() -> list[str]:
    """Builds to test: every one the CPU runs, unless the kernels are switched off for this run."""
    return kernels.host_isas() if kernels.available() else []


ISAS = pytest.mark.parametrize("isa", _runnable() or [pytest.param("none", marks=pytest.mark.skip("kernels off"))])


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), w.double()).float()


def linear(isa: str, bw: BlockedWeight, x: torch.Tensor, n: int | None = None) -> torch.Tensor:
    n = bw.rows if n is None else n
    return kernels.library(isa).draft_linear(x, bw.data, -(-n // LANES))[:, :n]


def test_host_code_builds_are_keyed_by_the_host(monkeypatch, tmp_path):
    """The generic build is compiled for the host (-march=native): a cache shared by two CPUs keeps one build
    per CPU; the intrinsic builds target a fixed ISA and are shared."""
    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path))
    here = {isa: kernels._build_dir(isa) for isa in kernels.ISAS}
    monkeypatch.setattr(kernels, "_host_fingerprint", lambda: b"another CPU")
    assert kernels._build_dir("generic") != here["generic"]
    assert kernels._build_dir("generic", native=False) == kernels._build_dir("generic", native=False)
    assert all(kernels._build_dir(isa) == here[isa] for isa in ("avx512", "avx2"))


def test_a_compiler_without_march_native_gets_the_baseline_build(monkeypatch, tmp_path):
    """The generic build asks for -march=native first; where the compiler refuses, it is built again without it,
    and a build that fails both ways is a reason, never an exception (the library falls back)."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path))
    calls = []

    def refusing_load(name, sources, extra_cflags, build_directory, **kw):
        calls.append(("-march=native" in extra_cflags, build_directory))
        raise RuntimeError("unrecognized command-line option")

    monkeypatch.setattr(ext, "load", refusing_load)
    why = kernels._build("generic")
    assert [native for native, _ in calls] == [True, False] and calls[0][1] != calls[1][1]
    assert why.startswith("generic build failed: RuntimeError")
    calls.clear()
    assert kernels._build("avx2").startswith("avx2 build failed") and [n for n, _ in calls] == [False]


def test_host_isas_and_forcing_a_narrower_one(monkeypatch):
    """generic runs everywhere; the active build is the widest one, or the one SPECHEAD_ISA names."""
    isas = kernels.host_isas()
    assert isas[-1] == "generic" and all(i in kernels.ISAS for i in isas)
    if kernels.available():
        assert kernels.active_isa() in isas
    with pytest.raises(ValueError, match="unknown ISA"):
        kernels.library("sse9")
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("SPECHEAD_KERNELS", "1")
    monkeypatch.setenv("SPECHEAD_ISA", "generic")
    assert kernels.active_isa() == "generic"
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("SPECHEAD_ISA", "mmx")
    with pytest.raises(ValueError, match="SPECHEAD_ISA"):
        kernels.active_isa()
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setenv("SPECHEAD_KERNELS", "0")
    assert kernels.active_isa() is None and "SPECHEAD_KERNELS=0" in kernels.unavailable_reason()


def test_using_swaps_the_active_build_for_a_block():
    """kernels.using(lib): ops() is lib inside the block (the library's layers call that build), the active build
    again after it, an exception included (what benchmarks/kernel_ab.py relies on)."""
    try:
        generic = kernels.library("generic")
    except RuntimeError as e:
        pytest.skip(str(e))
    if not kernels.available():  # no active build to stand in for
        with pytest.raises(RuntimeError, match="unavailable"), kernels.using(generic):
            pass
        return
    before = kernels.ops()
    x, w = torch.randn(3, 64), torch.randn(40, 64)
    with pytest.raises(KeyError), kernels.using(generic):
        assert kernels.ops() is generic
        y = kernels.ops().draft_linear(x, BlockedWeight(w).data, 3)[:, :40]
        torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
        raise KeyError
    assert kernels._state["ops"] is before


@ISAS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 64), (160, 576), (48, 4096), (21, 2)])
def test_kernel_matches_linear_for_every_row_count(isa, dtype, shape):
    """Every row count up to 40 (tiles per row count, more rows in equal chunks); N need not be a multiple
    of 16. fp32 accumulation in another order than F.linear: equal to ~1e-6 relative."""
    g = torch.Generator().manual_seed(0)
    n, k = shape
    w = torch.randn(n, k, generator=g).to(dtype)
    bw = BlockedWeight(w)
    assert bw.blocked and bw.shape == (n, k)
    for m in [*range(1, 17), 23, 40]:
        x = torch.randn(m, k, generator=g).to(dtype)
        got = linear(isa, bw, x)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got, reference(x, w), rtol=1e-5, atol=1e-5 * k**0.5)
    assert torch.equal(bw.read(), w)


@ISAS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(200, 320), (37, 66)])
def test_outputs_do_not_depend_on_the_row_count(isa, dtype, shape):
    """The row-count property (``BlockedWeight``): a row's outputs are bitwise the same alone (a decode step) or
    among up to 63 others (a verification, a batched round), at every row count from 1 to 64."""
    g = torch.Generator().manual_seed(4)
    n, k = shape
    w = torch.randn(n, k, generator=g).to(dtype)
    bw = BlockedWeight(w)
    x = torch.randn(64, k, generator=g).to(dtype)
    alone = torch.cat([linear(isa, bw, x[i : i + 1]) for i in range(64)])
    for m in range(1, 65):
        assert torch.equal(linear(isa, bw, x[:m]), alone[:m]), m


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
    """Where no build can run (no compiler, SPECHEAD_KERNELS=0, CUDA), the plain layout and F.linear serve."""
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


@ISAS
def test_kernel_rejects_bad_shapes(isa):
    bw = BlockedWeight(torch.randn(32, 64))
    lib = kernels.library(isa)
    with pytest.raises(RuntimeError, match="columns"):
        lib.draft_linear(torch.randn(2, 63), bw.data, 2)
    with pytest.raises(RuntimeError, match="blocks out of range"):
        lib.draft_linear(torch.randn(2, 64), bw.data, 3)


@ISAS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [5, 37, 3072, 49152])
def test_row_topk_values_indices_and_log_softmax(isa, dtype, V):
    """Top-k values equal torch.topk's (indices may differ only among ties), the fused log-softmax equals
    the exact log_softmax at those indices, an index map is applied, and -inf entries are handled."""
    lib = kernels.library(isa)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, V, generator=g) * 4).to(dtype)
    x[0, : V // 2] = float("-inf")
    x[1] = x[1, 0]  # a row of ties
    k = min(10, V)
    vals, idx = lib.row_topk(x, k)
    ref = x.float().topk(k, dim=-1)
    assert torch.equal(vals, ref.values)
    assert torch.equal(x.float().gather(1, idx), ref.values)
    assert torch.equal(idx[1], torch.arange(k))  # ties: the lower index first
    logp, idx2 = lib.row_topk(x, k, True)
    assert torch.equal(idx2, idx)
    exact = x.double().log_softmax(-1).gather(1, idx).float()  # (float32 log_softmax is itself off by ~5e-6 here)
    torch.testing.assert_close(logp, exact, rtol=0, atol=1e-6)
    ids = torch.randperm(V, generator=g)
    _, mapped = lib.row_topk(x, k, False, ids)
    assert torch.equal(mapped, ids[idx])
    with pytest.raises(RuntimeError, match="index_map"):
        lib.row_topk(x, k, False, ids[:-1])


@ISAS
def test_row_topk_worst_case_order_is_still_exact(isa):
    """Ascending rows make every element beat the current k-th best: the slow path, still exact."""
    x = torch.arange(5000.0).repeat(3, 1)
    vals, idx = kernels.library(isa).row_topk(x, 8)
    assert torch.equal(idx, torch.arange(4999, 4991, -1).repeat(3, 1)) and torch.equal(vals, idx.float())


@ISAS
def test_row_topk_ranks_nan_lowest(isa):
    x = torch.tensor([[float("nan"), 1.0, float("nan"), 3.0, 2.0, 0.5]])
    vals, idx = kernels.library(isa).row_topk(x, 3)
    assert idx.tolist() == [[3, 4, 1]] and vals.tolist() == [[3.0, 2.0, 1.0]]


@ISAS
def test_rms_norm_matches_torch_and_does_not_depend_on_the_row_count(isa):
    lib = kernels.library(isa)
    g = torch.Generator().manual_seed(5)
    for d in (576, 640, 37):
        x, w = torch.randn(16, d, generator=g) * 3, torch.randn(d, generator=g)
        got = lib.rms_norm(x, w, 1e-6)
        torch.testing.assert_close(got, F.rms_norm(x.double(), (d,), w.double(), 1e-6).float(), rtol=1e-6, atol=1e-6)
        assert all(torch.equal(lib.rms_norm(x[i : i + 1], w, 1e-6)[0], got[i]) for i in range(16))
    with pytest.raises(RuntimeError, match="w must be"):
        lib.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


@ISAS
def test_rope_is_the_tensor_version(isa):
    """Bitwise the tensor ops of model.apply_rope: the same products and sums, in one pass."""
    from spechead.model.layers import Rotary

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 12, 64, generator=g)
    cos, sin = Rotary(64, 100, 10000.0)(torch.tensor([3, 9, 9, 40, 99]))
    half = 32
    want = x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]
    assert torch.equal(kernels.library(isa).rope(x, cos, sin), want)


def _attention_case(g: torch.Generator, T: int, start: int, heads: int = 6, kv: int = 2, d: int = 64):
    q, k, v = (torch.randn(T, n * d, generator=g) for n in (heads, kv, kv))
    pos = torch.arange(start, start + T)
    from spechead.model.layers import Rotary

    cos, sin = Rotary(d, 512, 10000.0)(pos)
    caches = [torch.randn(3, kv, 512, d, generator=g) for _ in range(2)]
    return q, k, v, cos, sin, caches


@ISAS
@pytest.mark.parametrize("d", [64, 128, 20])
def test_attend_is_attention_over_the_visible_slots(isa, d):
    """RoPE, the cache write and masked grouped-query attention: SDPA's result (to rounding), the cache holding
    the roped keys and the values at the rows' slots, and nothing else touched."""
    lib = kernels.library(isa)
    g = torch.Generator().manual_seed(11)
    T, start, lane, heads, kv = 5, 37, 1, 6, 2
    q, k, v, cos, sin, (kc, vc) = _attention_case(g, T, start, heads, kv, d)
    mask = torch.rand(T, start + T, generator=g) < 0.7
    mask[:, start:] &= torch.ones(T, T, dtype=torch.bool).tril()
    mask[torch.arange(T), start + torch.arange(T)] = True  # each row sees itself
    kc0, vc0 = kc.clone(), vc.clone()
    for m in (mask, None):
        got = lib.attend(q, k, v, cos, sin, kc, vc, lane, start, m, 0, 0.3)
        rope = lambda t, n: lib.rope(t.view(T, n, d).contiguous(), cos, sin).transpose(0, 1)  # noqa: E731
        keys = torch.cat([kc0[lane, :, :start], rope(k, kv)], dim=1)
        vals = torch.cat([vc0[lane, :, :start], v.view(T, kv, d).transpose(0, 1)], dim=1)
        want = (
            F.scaled_dot_product_attention(
                rope(q, heads)[None].double(),
                keys[None].double(),
                vals[None].double(),
                attn_mask=m if m is not None else torch.ones(T, start + T, dtype=torch.bool).tril(start),
                scale=0.3,
                enable_gqa=True,
            )[0]
            .transpose(0, 1)
            .reshape(T, -1)
        )
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
        assert torch.equal(kc[lane, :, start : start + T], rope(k, kv))
        assert torch.equal(kc[lane, :, :start], kc0[lane, :, :start])
        assert torch.equal(vc[lane, :, start : start + T], v.view(T, kv, d).transpose(0, 1))
        assert torch.equal(kc[0], kc0[0]) and torch.equal(kc[2], kc0[2]) and torch.equal(vc[0], vc0[0])
    with pytest.raises(RuntimeError, match="sees no slot"):
        lib.attend(q, k, v, cos, sin, kc, vc, lane, start, torch.zeros_like(mask), 0, 0.3)
    with pytest.raises(RuntimeError, match="out of range"):
        lib.attend(q, k, v, cos, sin, kc, vc, 3, start, None, 0, 0.3)


@ISAS
def test_attend_over_chunks_and_a_window_is_attention_whatever_the_threads(isa):
    """A row's slots are attended in fixed chunks of the lane, merged in order: over several chunks, from a window's
    first slot (Gemma's local layers), with slots masked out and a chunk some rows see none of, the result is SDPA's,
    and the same bits on one thread as on two (the tasks and their order change, a row's arithmetic does not)."""
    lib = kernels.library(isa)
    g = torch.Generator().manual_seed(14)
    T, start, kv_from, heads, kv, d = 3, 700, 100, 4, 1, 64
    q, k, v = (torch.randn(T, n * d, generator=g) for n in (heads, kv, kv))
    from spechead.model.layers import Rotary

    cos, sin = Rotary(d, 1024, 10000.0)(torch.arange(start, start + T))
    caches = [torch.randn(1, kv, 1024, d, generator=g) for _ in range(2)]
    S = start + T - kv_from
    mask = torch.rand(T, S, generator=g) < 0.8
    mask[:, S - T :] = torch.ones(T, T, dtype=torch.bool).tril()
    mask[0, 156:412] = False  # row 0 sees nothing of slots 256-511: a whole chunk it skips
    outs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            kc, vc = caches[0].clone(), caches[1].clone()
            outs.append(lib.attend(q, k, v, cos, sin, kc, vc, 0, start, mask, kv_from, 0.125))
        finally:
            torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    rope = lambda t, n: lib.rope(t.view(T, n, d).contiguous(), cos, sin).transpose(0, 1)  # noqa: E731
    keys = torch.cat([caches[0][0, :, kv_from:start], rope(k, kv)], dim=1)
    vals = torch.cat([caches[1][0, :, kv_from:start], v.view(T, kv, d).transpose(0, 1)], dim=1)
    want = F.scaled_dot_product_attention(
        rope(q, heads)[None].double(), keys[None].double(), vals[None].double(), attn_mask=mask, scale=0.125,
        enable_gqa=True,
    )[0].transpose(0, 1).reshape(T, -1)  # fmt: skip
    torch.testing.assert_close(outs[0], want.float(), rtol=1e-5, atol=1e-5)


@ISAS
@pytest.mark.parametrize("start", [300, 254])
def test_attend_row_is_the_decode_step_it_stands_for(isa, start):
    """A tree node's row is bitwise what a decode step at its position gives once its ancestors are committed:
    the same keys and values, visited in the same order (what makes a verification agree with AR decoding). From
    slot 254 the branches cross the attention's chunk boundary at 256 at other slots than their decode steps do."""
    lib = kernels.library(isa)
    g = torch.Generator().manual_seed(12)
    heads, kv, d = 9, 3, 64
    # a tree of 6 nodes, two branches: 0 -> 1 -> 3 -> 5 and 0 -> 2 -> 4
    parent = [-1, 0, 0, 1, 2, 3]
    T = len(parent)
    q, k, v, cos, sin, (kc, vc) = _attention_case(g, T, start, heads, kv, d)
    depth = [0] * T
    for i, p in enumerate(parent):
        depth[i] = 0 if p < 0 else depth[p] + 1
    from spechead.model.layers import Rotary

    cos, sin = Rotary(d, 512, 10000.0)(start + torch.tensor(depth))  # node i at position start + depth
    mask = torch.zeros(T, start + T, dtype=torch.bool)
    mask[:, :start] = True
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, start + j] = True
            j = parent[j]
    tree = lib.attend(q, k, v, cos, sin, kc.clone(), vc.clone(), 0, start, mask, 0, 0.125)
    for branch in ([0, 1, 3, 5], [0, 2, 4]):
        kc2, vc2 = kc.clone(), vc.clone()
        for n, i in enumerate(branch):  # decode the branch one token at a time, each at the next slot
            r = slice(i, i + 1)
            step = lib.attend(q[r], k[r], v[r], cos[r], sin[r], kc2, vc2, 0, start + n, None, 0, 0.125)
            assert torch.equal(step[0], tree[i]), (branch, i)


@ISAS
def test_silu_mul_is_silu_gate_times_up(isa):
    lib = kernels.library(isa)
    g = torch.Generator().manual_seed(13)
    gu = torch.randn(7, 2 * 77, generator=g) * 8
    gu[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    got = lib.silu_mul(gu)
    want = F.silu(gu[:, :77].double()) * gu[:, 77:].double()
    torch.testing.assert_close(got, want.float(), rtol=2e-6, atol=1e-6)
    assert all(torch.equal(lib.silu_mul(gu[i : i + 1])[0], got[i]) for i in range(7))
    # the vector lanes give what the scalar tail gives: 77 = 4 x 16 + 13 = 9 x 8 + 5, the tail repeats the head
    tail = torch.cat([gu[:, :64], gu[:, :13], gu[:, 77:141], gu[:, 77:90]], dim=1)
    both = lib.silu_mul(tail)
    assert torch.equal(both[:, 64:], both[:, :13])


@ISAS
def test_a_layer_over_several_requests_is_each_request_alone(isa):
    """decoder_layers runs every request's attention in one parallel loop (a batch of decode steps and a tree):
    each request's rows and cache lane come out bitwise as when the layer runs that request alone. A stack of two
    layers is the one-layer op twice, and ``keep`` returns the second layer's input."""
    lib = kernels.library(isa)
    g = torch.Generator().manual_seed(5)
    d, heads, kv, hd, inter = 128, 4, 2, 32, 96
    widths = [(heads + 2 * kv) * hd, d, 2 * inter, d]
    fan_in = [d, heads * hd, d, inter]
    ws = [BlockedWeight(torch.randn(n, k, generator=g) / k**0.5).data for n, k in zip(widths, fan_in, strict=True)]
    ln1, ln2 = 1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)
    caches = [torch.randn(4, kv, 320, hd, generator=g) for _ in range(2)]
    # (lane, start, rows, mask): a one-row step, a 4-node tree past the attention's first chunk, a two-row chunk
    tree = torch.ones(4, 290 + 4, dtype=torch.bool)
    tree[:, 290:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    parts = [(0, 90, 1, None), (2, 290, 4, tree), (3, 70, 2, None)]
    T = sum(p[2] for p in parts)
    x = torch.randn(T, d, generator=g)
    pos = torch.cat([torch.arange(s, s + t) for _, s, t, _ in parts])
    from spechead.model.layers import Rotary

    cos, sin = Rotary(hd, 512, 10000.0)(pos)
    row0 = [0, 1, 5]

    def layers(idx: list[int], x: torch.Tensor, *caches: torch.Tensor, keep=()) -> list[torch.Tensor]:
        rows = torch.cat([torch.arange(row0[i], row0[i] + parts[i][2]) for i in idx])
        r0 = [sum(parts[j][2] for j in idx[:n]) for n in range(len(idx))]
        none = torch.empty(0)
        stack = [t for k in range(0, len(caches), 2) for t in (ln1, ln2, *[none] * 4, caches[k], caches[k + 1], *ws)]
        c, s = cos[rows].contiguous(), sin[rows].contiguous()
        masks, firsts = [parts[i][3] for i in idx], [0] * len(idx)
        return lib.decoder_layers(
            x[rows], stack, 1, 1e-5, widths, False, [0] * (len(caches) // 2), c, s, c, s, r0,
            [parts[i][2] for i in idx], [parts[i][0] for i in idx], [parts[i][1] for i in idx],
            masks, firsts, masks, firsts, hd**-0.5, list(keep),
        )  # fmt: skip

    def layer(idx: list[int], kc: torch.Tensor, vc: torch.Tensor, rows_in: torch.Tensor = x) -> torch.Tensor:
        return layers(idx, rows_in, kc, vc)[-1]

    kc, vc = caches[0].clone(), caches[1].clone()
    together = layer([0, 1, 2], kc, vc)
    for i, (lane, _, t, _) in enumerate(parts):
        kc1, vc1 = caches[0].clone(), caches[1].clone()
        alone = layer([i], kc1, vc1)
        assert torch.equal(together[row0[i] : row0[i] + t], alone)
        assert torch.equal(kc[lane], kc1[lane]) and torch.equal(vc[lane], vc1[lane])

    one = [c.clone() for c in caches]
    first = layer([0, 1, 2], *one)
    second = layer([0, 1, 2], *[c.clone() for c in caches], rows_in=first)
    mid, out = layers([0, 1, 2], x, *[c.clone() for c in caches], *[c.clone() for c in caches], keep=[1])
    assert torch.equal(mid, first) and torch.equal(out, second)
