"""The integer block GEMM (``qlinear``): its products against exact integer arithmetic, and the contract lossless
speculation rests on: a row's bits independent of the row count, of the kernel path and of the thread count."""

import pytest
import torch

from spechead import kernels
from spechead.kernels.qlinear import QuantLinear, QuantWeight
from spechead.kernels.quant import QuantBlocks, quantize

pytestmark = pytest.mark.paths

FORMATS = ("q8", "q4")


def _runnable() -> list[str]:
    return kernels.host_isas() if kernels.available() else []


ISAS = pytest.mark.parametrize("isa", _runnable() or [pytest.param("none", marks=pytest.mark.skip("kernels off"))])


def weight(fmt: str, n: int = 100, k: int = 576, seed: int = 0) -> tuple[QuantBlocks, QuantWeight]:
    g = torch.Generator().manual_seed(seed)
    blocks = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    return blocks, QuantWeight.pack(blocks)


def call(isa: str, w: QuantWeight, x: torch.Tensor, n: int | None = None) -> torch.Tensor:
    return kernels.library(isa).qlinear(x, w.data, w.scale, w.min, w.rows if n is None else n)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_round_trips_every_row(fmt):
    blocks, w = weight(fmt, n=37)
    back = w.blocks()
    assert torch.equal(back.q, blocks.q) and torch.equal(back.scale, blocks.scale)
    assert (back.min is None) == (blocks.min is None) and (back.min is None or torch.equal(back.min, blocks.min))
    idx = torch.tensor([[36, 0], [17, 5]])
    assert torch.equal(w.dequantize_rows(idx), blocks.dequantize()[idx])


@ISAS
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_read_from_the_panels_are_the_blocks_dequantized(isa, fmt):
    """``qrows`` (an embedding lookup on a tied table) gives the bits of ``QuantBlocks.dequantize`` on every path,
    and refuses a row past the table."""
    blocks, w = weight(fmt, n=45, seed=3)
    lib = kernels.library(isa)
    idx = torch.tensor([[44, 0, 16], [15, 17, 44]])
    assert torch.equal(lib.qrows(w.data, w.scale, w.min, idx, w.rows), blocks.dequantize()[idx])
    with pytest.raises(RuntimeError, match="out of range"):
        lib.qrows(w.data, w.scale, w.min, torch.tensor([45]), w.rows)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_keeps_each_block_within_half_a_step(fmt):
    w = torch.randn(8, 64)
    blocks = quantize(w, fmt)
    step = blocks.scale.repeat_interleave(32, dim=1)
    assert ((blocks.dequantize() - w).abs() <= 0.5 * step + 1e-6).all()


@ISAS
@pytest.mark.parametrize("fmt", FORMATS)
def test_products_are_the_exact_integer_block_sums(isa, fmt):
    """Against a float64 evaluation of the same definition: activations quantized per row and 32-value block, the
    block's integer dot product times both scales, plus the minimum's term."""
    blocks, w = weight(fmt, n=45)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(1))
    y = call(isa, w, x)
    xb = x.view(5, 18, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    qa = torch.round(xb * (torch.full_like(amax, 127.0) / amax)).double()  # fp32, rounded as the kernel rounds
    da = (amax / 127.0).double()
    qw = blocks.q.double().view(45, 18, 32)
    isum = torch.einsum("mbk,nbk->mnb", qa, qw)
    want = (isum * blocks.scale.double()[None] * da[:, None, :, 0]).sum(-1)
    if blocks.min is not None:
        want = want + (blocks.min.double()[None] * (da[..., 0] * qa.sum(-1))[:, None]).sum(-1)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
    exact = x @ blocks.dequantize().T  # the activations' rounding is all that separates it from the float product
    assert (y - exact).abs().max() < 0.02 * exact.abs().max()


@ISAS
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_row_count(isa, fmt):
    _, w = weight(fmt, n=300, k=1536)
    x = torch.randn(64, 1536)
    full = call(isa, w, x)
    for m in range(1, 65):
        assert torch.equal(call(isa, w, x[:m]), full[:m]), m
    assert torch.equal(call(isa, w, x[10:11]), full[10:11])


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_path_and_thread_count_gives_the_same_bits(fmt):
    """The contract across builds: exact integer sums and one epilogue make every path's bits the same."""
    isas = _runnable()
    if not isas:
        pytest.skip("kernels off")
    _, w = weight(fmt, n=200, k=640)
    assert_same_bits_everywhere(isas, w, torch.randn(17, 640))


def assert_same_bits_everywhere(isas: list[str], w: QuantWeight, x: torch.Tensor) -> None:
    """Every path the CPU runs gives the first path's bits, at the current thread count and at one thread."""
    first = call(isas[0], w, x)
    threads = torch.get_num_threads()
    try:
        for n in (threads, 1):
            torch.set_num_threads(n)
            for isa in isas:
                assert torch.equal(call(isa, w, x), first), (isa, n)
    finally:
        torch.set_num_threads(threads)


def test_activation_blocks_quantize_alike_on_every_path():
    """The activations' quantization (vector where the build has it, scalar otherwise) at its edges: an all-zero
    block, scaled values exactly halfway between two integers, magnitudes near fp32's ends. Every path and thread
    count gives the same bits, and a halfway value rounds to even."""
    isas = _runnable()
    if not isas:
        pytest.skip("kernels off")
    _, w = weight("q8", n=32, k=128)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(2))
    x[0, :32] = 0.0
    x[1, :32] = (torch.arange(32) - 15.5) / 15.5  # amax 1: every value times 127 lies between two integers
    x[2, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, 4.5, 5.5, 6.5, 7.5] * 4)  # amax 127: x * 1 is x, halfway
    x[3] *= 1e-30
    x[4] *= 1e30
    assert_same_bits_everywhere(isas, w, x)
    # a weight of ones reads back each block's quantized sum times its scale: row 2's first block rounds to
    # [127, 0, 2, 2, 4, 6, 6, 8] (half to even: 155 a quarter, where half away from zero gives 159)
    ones = QuantWeight.pack(QuantBlocks(torch.ones(16, 128, dtype=torch.int8), torch.ones(16, 4), None, "q8"))
    rest = x[2, 32:].view(-1, 32)
    amax = rest.abs().amax(-1, keepdim=True)
    want = 4 * 155.0 + float((torch.round(rest * (127.0 / amax)) * (amax / 127.0)).sum())
    assert call(isas[0], ones, x[2:3])[0, 0].item() == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tensor_reference_keeps_rows_independent(fmt):
    """Without a kernel build the same arithmetic runs as tensor ops: rows still independent of each other, and
    within float rounding of the kernel."""
    _, w = weight(fmt, n=50)
    x = torch.randn(9, 576)
    ref = w.reference(x)
    assert all(torch.equal(w.reference(x[:m]), ref[:m]) for m in (1, 4, 9))
    if kernels.available():
        assert torch.allclose(w(x), ref, rtol=1e-5, atol=1e-5)


def test_a_quant_linear_keeps_its_output_width_and_dtype():
    _, w = weight("q4", n=21)
    lin = QuantLinear(w)
    y = lin(torch.randn(3, 576))
    assert y.shape == (3, 21) and y.dtype == torch.float32
    assert lin.weight.shape == (21, 576)


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(4, 40), "q8")
    with pytest.raises(ValueError, match="unknown block format"):
        quantize(torch.randn(4, 64), "q3")
    with pytest.raises(ValueError, match="0..15"):
        QuantBlocks(torch.full((2, 32), 16, dtype=torch.int8), torch.ones(2, 1), torch.zeros(2, 1), "q4")
