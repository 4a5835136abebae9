"""The one few-row linear layer: the blocked-layout kernel where it runs, else F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from spechead import kernels
from spechead.kernels import LANES


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


class PackedLinear:
    """``x @ W.T`` in float32 for a weight that never changes: a draft head's product, few rows against many.

    On the kernel's blocked layout wherever a build runs (every x86-64 and, portably, elsewhere), else
    ``F.linear`` (other devices, tiny matrices, ``SPECHEAD_KERNELS=0``). Either way one copy of W.
    """

    MIN_NUMEL = 1 << 16  # below this the kernel's fixed cost (transposing x, forking threads) outweighs the gain

    def __init__(self, weight: Tensor) -> None:
        weight = weight.detach()
        self.shape, self.dtype = weight.shape, weight.dtype
        self.weight: Tensor | None = None
        self.blocked: BlockedWeight | None = None
        if weight.numel() >= self.MIN_NUMEL and kernels.supports(weight):
            self.blocked = BlockedWeight(weight)
            self.nbytes = self.blocked.nbytes
        else:
            self.weight = weight.contiguous()
            self.nbytes = weight.numel() * weight.element_size()

    @property
    def kind(self) -> str:
        """Which path serves the calls: ``kernel`` or ``linear``."""
        return "kernel" if self.blocked is not None else "linear"

    def __call__(self, x: Tensor) -> Tensor:
        if self.blocked is not None:
            return self.blocked(x)
        return F.linear(x.to(self.dtype), self.weight).float()
