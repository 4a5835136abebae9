"""The one few-row linear layer (``PackedLinear``): the blocked-layout kernel where it runs, MKL's packed GEMM
where only that does, else F.linear; ``BlockedWeight`` is the kernel's weight layout it (and NanoSpec) use."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spechead import kernels
from spechead.kernels import LANES

_PROMPT = ContextVar("spechead_prompt_rows", default=False)


@contextmanager
def prompt_rows() -> Iterator[None]:
    """Calls made inside take the path a prompt of their row count takes however wide the layouts were made
    (the kernel up to its dtype's default reach, else F.linear): a prompt's KV and logits then do not depend on
    the tree or batch a decoder laid the target out for, so AR, a tree and a batched server start from the same
    bits. Decode steps and verifications stay outside: their rows must take the kernel to match each other."""
    token = _PROMPT.set(True)
    try:
        yield
    finally:
        _PROMPT.reset(token)


class BlockedWeight:
    """``x @ W.T`` (float32 result) for a [N, K] weight held in the kernel's blocked layout, with room
    for ``capacity`` rows; rows can be rewritten in place (``write``) and a call can use only the first
    ``n`` rows. Falls back to a plain row-major copy and ``F.linear`` where the kernel is unavailable.
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


def mkl_packing_available() -> bool:
    """Whether this torch has MKL's packed GEMM (a private op: used only where it exists)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear(nn.Module):
    """``x @ W.T (+ b)`` for few rows against many: every draft head's product and the target's projections.

    Why one layer: a draft head (a handful of rows) and a target's decode step (1 row) or tree verification
    (4-16 rows) are the same product, which should cost the bytes of W. Library GEMMs are not with so few rows
    (MKL's sgemm repacks the whole weight on every few-row call: verifying 8 tokens cost 2.1x a decode step on
    the 2-core CPU, docs/results.md "Verification cost"). The paths, first that applies:

    * spechead's blocked-layout kernel (``BlockedWeight``) wherever a build runs (every x86-64 and, portably,
      elsewhere): one copy of W serves any row count, and each output is accumulated in one order whatever the
      row count, so a token's logits are bitwise the same in a decode step and in a verification;
    * MKL's packed GEMM at the row counts ``pack`` was given (kernels off: ``SPECHEAD_KERNELS=0``, no compiler;
      fp32 on a torch that has the op): ~0.7x the time of ``F.linear`` for a 4-16 token verification of
      the demo target on the 2-core CPU;
    * ``F.linear`` (other devices, tiny head matrices, longer inputs such as a prefill).

    Two uses, two constructors. ``PackedLinear(weight)``: a frozen head product with a float32 result, the
    kernel for every call (the plain weight is then dropped: one copy of W either way), ``F.linear`` below
    ``MIN_NUMEL``. ``PackedLinear.from_linear(linear)``: a stand-in for a target's or a drafter's ``nn.Linear``
    (same parameters, shared so tied weights stay tied and the state dict keeps its names; result in the input's
    dtype), with the kernel for up to ``KERNEL_ROWS`` rows once ``pack`` has laid the weight out (one more copy of
    it); under autograd it is the plain product, and a weight changed in place gets its layouts rebuilt.
    """

    # a target projection: longer inputs (prefill) use F.linear, unless ``pack`` was asked for more rows (a large
    # tree or a batched decoder's verification: the kernel keeps their logits bitwise those of a decode step).
    # fp32 weights keep the kernel up to 256 rows: a prefill of 64 / 200 tokens of the demo target took 120 / 374 ms
    # on it against 244 / 503 ms on F.linear (MKL sgemm; AMD EPYC Zen 4, 2 threads); bf16 leaves it at 16 rows,
    # where oneDNN's bf16 GEMM overtakes it on CPUs with bf16 dot products (64 rows of the demo head: 18.9 ms on
    # the kernel, 11.9 on F.linear, same machine)
    KERNEL_ROWS = 16
    KERNEL_ROWS_FP32 = 256
    MIN_NUMEL = 1 << 16  # a head below this: the kernel's fixed cost (transposing x, forking threads) beats the gain

    def __init__(self, weight: Tensor, bias: Tensor | None = None, shared: bool = False) -> None:
        super().__init__()
        self.shape, self.dtype = weight.shape, weight.dtype
        self.blocked: BlockedWeight | None = None
        self.shares_layout = False  # the layout was already built for the same tensor (``BlockedWeight.of``)
        self.packed: dict[int, Tensor] = {}  # rows -> MKL-packed weight
        # the kernel serves calls of up to this many rows (None: every call)
        reach = self.KERNEL_ROWS_FP32 if weight.dtype == torch.float32 else self.KERNEL_ROWS
        self.max_rows = reach if shared else None
        self.prompt_rows = self.max_rows  # a prompt's reach (``prompt_rows``): never widened by ``pack``
        # a target's LM head: every call on the kernel, whatever its rows, so a prompt's last row gives AR's
        # bits even when a head asks for many prompt rows (``Transformer.prepack`` sets it)
        self.every_row = False
        self.out_dtype = None if shared else torch.float32  # None: the input's dtype
        if shared:  # a model's projection (``from_linear``)
            self.weight, self.bias = weight, bias
            self._laid_out = _version(weight)  # the weight's version its layouts were built from
            return
        self.weight: Tensor | None = None
        self.bias = bias
        if weight.numel() >= self.MIN_NUMEL and kernels.supports(weight):
            self.shares_layout = BlockedWeight.shared(weight) is not None  # a tied head: the target's layout
            self.blocked = BlockedWeight.of(weight)
        else:
            self.weight = weight.detach().contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        """A target's projection: ``linear``'s own parameters (shared, so tied weights stay tied), laid out for
        few rows by ``pack``."""
        return cls(linear.weight, linear.bias, shared=True)

    def pack(self, rows: int) -> None:
        """Lay the weight out for ``rows``-row products: the kernel's layout (it serves every row count up to
        ``KERNEL_ROWS`` or ``rows``, whichever is more) where a build runs, else MKL's packing at exactly ``rows``
        rows (fp32)."""
        w = self.weight
        if kernels.supports(w):
            if self.blocked is None:
                self.blocked = BlockedWeight.of(w)
            if self.max_rows is not None:
                self.max_rows = max(self.max_rows, rows)
        elif rows >= 2 and rows not in self.packed and mkl_packing_available() and w.dtype == torch.float32:
            self.packed[rows] = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)

    @property
    def kind(self) -> str:
        """Which path serves the calls it was laid out for: ``kernel``, ``mkl`` or ``linear``."""
        return "kernel" if self.blocked is not None else "mkl" if self.packed else "linear"

    @property
    def nbytes(self) -> int:
        """Bytes held: the plain weight (if kept) plus every layout of it."""
        held = [self.weight, *self.packed.values()] if self.weight is not None else list(self.packed.values())
        n = sum(t.numel() * t.element_size() for t in held)
        return n + (self.blocked.nbytes if self.blocked is not None else 0)

    def _layouts_current(self, x: Tensor) -> bool:
        """A model's projection may be one being trained (a drafter a decoder laid out, trained afterwards): under
        autograd it takes F.linear, and a weight changed in place since its layouts were built gets them rebuilt."""
        w = self.weight
        if torch.is_grad_enabled() and (w.requires_grad or x.requires_grad):
            return False
        if _version(w) != self._laid_out:
            rows = sorted(self.packed)
            self.blocked, self.packed, self._laid_out = None, {}, _version(w)
            for r in rows or [1]:
                self.pack(r)
        return True

    def takes_kernel(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows runs on the kernel: up to the widened reach, a prompt's rows up to
        the default one (``prompt_rows``), every call for a head's own product or the target's LM head."""
        if self.blocked is None:
            return False
        reach = None if self.every_row else self.prompt_rows if _PROMPT.get() else self.max_rows
        return reach is None or rows <= reach

    def forward(self, x: Tensor) -> Tensor:
        if self.max_rows is not None and not self._layouts_current(x):  # (a head's own product never trains)
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        if self.blocked is not None and (self.max_rows is None or x.dim() == 2) and self.takes_kernel(x.shape[0]):
            y = self.blocked(x)
            if self.bias is not None:
                y = y + self.bias
            return y.to(self.out_dtype or x.dtype)
        # (looked up only when MKL packing is in use: a dict lookup by a traced row count makes
        # torch.compile specialise on it and recompile for every prompt length)
        packed = self.packed.get(x.shape[0]) if self.packed and x.dim() == 2 and not _PROMPT.get() else None
        if packed is not None:
            return torch.ops.mkl._mkl_linear(x, packed, self.weight, self.bias, x.shape[0])
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(self.out_dtype or x.dtype)


def prepack_linears(model: nn.Module, probe: Tensor, rows: int, skip: tuple[str, ...] = ()) -> bool:
    """Every ``nn.Linear`` of ``model`` (but those under the submodule names in ``skip``) as a ``PackedLinear``
    sharing its parameters (the state dict keeps its names; autograd still sees the plain product), laid out for
    ``rows``-row products: spechead's kernel for any row count where a build runs for ``probe``'s kind of weight,
    else MKL's packing at ``rows`` rows (fp32). Returns whether a layout applies (False on other devices, or with
    neither). Idempotent."""
    if probe.device.type != "cpu":
        return False
    if not kernels.supports(probe) and (rows < 2 or probe.dtype != torch.float32 or not mkl_packing_available()):
        return False
    for name, child in list(model.named_modules()):
        if any(name == s or name.startswith(s + ".") for s in skip):
            continue
        if isinstance(child, nn.Linear):
            parent_name, _, attr = name.rpartition(".")
            child = PackedLinear.from_linear(child)
            setattr(model.get_submodule(parent_name), attr, child)
        if isinstance(child, PackedLinear):
            child.pack(rows)
    return True
