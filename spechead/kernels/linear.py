"""Few-row linear products on spechead's kernel: ``BlockedWeight`` (the kernel's weight layout and product),
``Projection`` (a model's ``nn.Linear`` on it) and ``PackedLinear`` (a draft head's frozen product on it).

A draft head (a handful of rows), a target's decode step (1 row) and a tree verification (4-16 rows, more when
requests share a round) are the same product, which should cost the bytes of W; library GEMMs repack or
re-tile the weight per call at so few rows. Where no kernel build runs (no compiler, ``SPECHEAD_KERNELS=0``,
other devices), every product is ``F.linear``.

Lossless speculation rests on one property of the kernel, stated and tested with ``BlockedWeight``: a row's
result bits do not depend on how many rows share the call. Without the kernel no product has that property (a
library GEMM picks its tiling by row count, MKL's packed GEMM included), so there a verification's logits agree
with the decode steps' to fp32 rounding only: greedy output is the target's AR output except where two logits
tie within that rounding. What holds on both paths: every call's path is a function of its own arguments, so a
prompt's prefill gives the same bits under AR, any tree and any batch, and so do decode steps.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spechead import kernels
from spechead.kernels import LANES
from spechead.kernels.qlinear import QuantWeight, swap_linears
from spechead.kernels.quant import QuantBlocks


class BlockedWeight:
    """``x @ W.T`` (float32 result) for a [N, K] weight held in the kernel's blocked layout, with room
    for ``capacity`` rows; rows can be rewritten in place (``write``) and a call can use only the first
    ``n`` rows. Falls back to a plain row-major copy and ``F.linear`` where the kernel is unavailable.

    The row-count property: ``draft_linear`` accumulates every output in fp32 in one fixed order (one chain of
    FMAs over k, ``csrc/gemm.cpp``) whatever the number of rows in the call, so row i of an m-row call is bitwise
    the 1-row call on x[i] for any m. A verification's rows are then bitwise the decode steps they stand
    for, and a request's rows in a batched round those it gets alone: greedy speculation reproduces the
    target's AR output token for token. tests/test_kernels.py checks it for 1..64 rows on every build the CPU
    runs. ``F.linear`` (the fallback) has no such property: library GEMMs choose their tiling by row count.
    """

    def __init__(self, weight: Tensor, capacity: int | None = None) -> None:
        n, k = weight.shape
        self.rows, self.in_features, self.dtype, self.device = n, k, weight.dtype, weight.device
        self.capacity = max(capacity or n, n)
        self.blocked = kernels.supports(weight)
        if self.blocked:
            nb = -(-self.capacity // LANES)
            if self.dtype == torch.bfloat16:
                self.data = torch.zeros(nb, k // 2, LANES, 2, dtype=self.dtype)
                # row-indexable view [nb, 16, K/2] of the bf16 pairs as 32-bit words: a row write then moves
                # 4-byte elements (6x faster than 2-byte ones for NanoSpec's 16 new rows a round)
                self._row_view = self.data.view(torch.int32)[..., 0].permute(0, 2, 1)
            else:
                self.data = torch.zeros(nb, k, LANES, dtype=self.dtype)
                self._row_view = self.data.permute(0, 2, 1)  # [nb, 16, K]
        else:
            self.data = torch.zeros(self.capacity, k, dtype=self.dtype, device=self.device)
        if n:
            self.write(torch.arange(n, device=self.device), weight.detach())

    @classmethod
    def of(cls, weight: Tensor) -> BlockedWeight:
        """The one read-only layout of ``weight`` (this very tensor, unchanged since): built at the first call,
        then shared.

        A tied draft head is the target's own LM-head tensor; sharing its layout saves a copy of it (113 MB for
        the demo target) and makes the draft head's first call of a round read what the verification that ended
        the previous round just read, from cache (2-3 % a round with the full head, 2-core CPU). A tensor changed
        in place since (a head being trained) gets a new layout. Never ``write`` to a shared layout."""
        layout = cls.shared(weight)
        if layout is None:
            layout = cls(weight.detach())
            version = _version(weight)
            if version is not None:  # (an inference tensor has no version counter: it is not shared)
                key = id(weight)
                _LAYOUTS[key] = (weakref.ref(weight, lambda _, k=key: _LAYOUTS.pop(k, None)), version, layout)
        return layout

    @staticmethod
    def shared(weight: Tensor) -> BlockedWeight | None:
        """The layout ``of`` already built for this tensor in its current state, if any."""
        hit = _LAYOUTS.get(id(weight))
        return hit[2] if hit is not None and hit[0]() is weight and hit[1] == _version(weight) else None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.in_features))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def write(self, slots: Tensor, rows: Tensor) -> None:
        """Rows [k, K] into slots [k] (the only per-round cost of an incremental update)."""
        rows = rows.to(self.dtype)
        if not self.blocked:
            self.data[slots] = rows
            return
        slots = slots.to(self.data.device)
        view = rows.contiguous().view(torch.int32) if self.dtype == torch.bfloat16 else rows
        self._row_view[slots // LANES, slots % LANES] = view

    def read(self, n: int | None = None) -> Tensor:
        """The first n rows [n, K], row-major (for checks and inspection)."""
        n = self.rows if n is None else n
        if not self.blocked:
            return self.data[:n].clone()
        order = (0, 2, 1, 3) if self.dtype == torch.bfloat16 else (0, 2, 1)
        return self.data.permute(order).reshape(-1, self.in_features)[:n]  # a copy: the layout is blocked

    def __call__(self, x: Tensor, n: int | None = None) -> Tensor:
        """Logits [B, n] in float32 against the first n rows (default: the rows given at construction)."""
        n = self.rows if n is None else n
        if not self.blocked:
            return F.linear(x.to(self.dtype), self.data[:n]).float()
        y = kernels.ops().draft_linear(x, self.data, -(-n // LANES))
        return y if y.shape[1] == n else y[:, :n].contiguous()


# BlockedWeight.of: id(tensor) -> (the tensor, its version when laid out, the layout)
_LAYOUTS: dict[int, tuple[weakref.ref, int, BlockedWeight]] = {}


def _version(t: Tensor) -> int | None:
    """The tensor's in-place version counter (None for an inference tensor, which keeps none)."""
    return None if t.is_inference() else t._version


class Projection(nn.Module):
    """A model's ``nn.Linear`` on the kernel: ``linear``'s own parameters (shared, so tied weights stay tied and
    the state dict keeps its names) and their blocked layout (one more copy of W); the result in the input's
    dtype. ``Transformer.prepack`` and ``Drafter.prepack`` swap one in for each ``nn.Linear`` whose weight a
    kernel build takes.

    Which path a call takes is a function of its arguments alone (``on_kernel``):

    * ``F.linear`` under autograd (the model still trains) and for input that is not 2-D;
    * ``F.linear`` for a prompt's prefill (``prefill=True``) of more than ``PREFILL_ROWS`` rows, where the library
      GEMM is the faster: a prompt's bits then depend on its length only, so AR, a tree and a batched server
      start from the same prompt state;
    * the kernel for every other call, at any row count: decode steps, verifications, batched rounds and the LM
      head over any rows, whose rows are then bitwise those of a decode step (``BlockedWeight``).

    A weight changed in place since it was laid out (a drafter trained after a decoder laid it out) gets a new
    layout at the next call.
    """

    # a prefill's rows on the kernel: fp32 prefills of a few hundred tokens run faster on it than on sgemm; in bf16
    # oneDNN's GEMM overtakes it past 16 rows on CPUs with bf16 dot products
    PREFILL_ROWS = {torch.float32: 256, torch.bfloat16: 16}

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.prefill_rows = self.PREFILL_ROWS[self.weight.dtype]
        self._layout = BlockedWeight.of(self.weight)
        self._laid_out = (self.weight, _version(self.weight))  # the tensor and version the layout holds

    @property
    def layout(self) -> BlockedWeight:
        """The weight's blocked layout, rebuilt where the weight was replaced or changed in place since."""
        w = self.weight
        if self._laid_out[0] is not w or self._laid_out[1] != _version(w):
            self._layout, self._laid_out = BlockedWeight.of(w), (w, _version(w))
        return self._layout

    def on_kernel(self, x: Tensor, prefill: bool = False) -> bool:
        """Whether a call on ``x`` takes the kernel (see the class docstring)."""
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
            return False
        return x.dim() == 2 and (not prefill or x.shape[0] <= self.prefill_rows)

    def forward(self, x: Tensor, prefill: bool = False) -> Tensor:
        if not self.on_kernel(x, prefill):
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        y = self.layout(x)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def prepack_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> bool:
    """Swap a ``Projection`` in for every ``nn.Linear`` of ``model`` (but those under the submodule names in
    ``skip``) whose weight a kernel build takes; the parameters are shared, so the state dict keeps its names and
    autograd still sees the plain product. Returns whether the model has any projection on the kernel (False on
    other devices and where no build runs). Idempotent."""
    swap_linears(model, lambda lin: Projection(lin) if kernels.supports(lin.weight) else None, skip)
    return any(isinstance(m, Projection) for m in model.modules())


class PackedLinear(nn.Module):
    """A draft head's product ``x @ W.T`` (float32 result) over a frozen weight: the kernel at any row count where
    it runs for W (the plain weight is then dropped: one copy of W), ``F.linear`` on the plain weight elsewhere
    and below ``MIN_NUMEL``. A weight that is a laid-out target's LM head (a tied head) shares its layout
    (``BlockedWeight.of``: ``shares_layout``)."""

    MIN_NUMEL = 1 << 16  # a head below this: the kernel's fixed cost (transposing x, forking threads) beats the gain

    def __init__(self, weight: Tensor | QuantWeight | QuantBlocks) -> None:
        super().__init__()
        self.weight: Tensor | None = None
        self.blocked: BlockedWeight | None = None
        self.quant: QuantWeight | None = None  # a quantized head's weight (the integer kernel's product)
        self.shares_layout = False  # the layout was already built for the same tensor (``BlockedWeight.of``)
        if isinstance(weight, (QuantWeight, QuantBlocks)):
            self.quant = weight if isinstance(weight, QuantWeight) else QuantWeight.pack(weight)
            self.shape, self.dtype = self.quant.shape, torch.float32
            return
        self.shape, self.dtype = weight.shape, weight.dtype
        if weight.numel() >= self.MIN_NUMEL and kernels.supports(weight):
            self.shares_layout = BlockedWeight.shared(weight) is not None
            self.blocked = BlockedWeight.of(weight)
        else:
            self.weight = weight.detach().contiguous()

    @property
    def kind(self) -> str:
        """Which path its calls take: ``kernel``, ``qkernel`` (a quantized weight) or ``linear``."""
        return "qkernel" if self.quant is not None else "kernel" if self.blocked is not None else "linear"

    @property
    def nbytes(self) -> int:
        """Bytes held: the layout, or the plain weight."""
        if self.quant is not None:
            return self.quant.nbytes
        w = self.weight
        return self.blocked.nbytes if self.blocked is not None else w.numel() * w.element_size()

    def forward(self, x: Tensor) -> Tensor:
        if self.quant is not None:
            return self.quant(x)
        if self.blocked is not None:
            return self.blocked(x)
        return F.linear(x.to(self.dtype), self.weight).float()
