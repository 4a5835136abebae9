"""The integer engine's linear product: ``QuantWeight`` (a quantized weight in the kernel's layout and its product)
and ``QuantLinear`` (a model's projection on it).

A [N, K] weight in 32-value blocks (``quant.QuantBlocks``: the GGUF file's own Q8_0 / Q4_x values, or a float
checkpoint quantized at load) is repacked once into panels of 16 output columns (``csrc/qgemm.cpp`` describes the
layout); a call quantizes each input row per 32-value block to int8 and sums each block's products exactly in int32.

The row-count property, the contract lossless speculation rests on: a row's result bits depend on that row and
the weight only; not on how many rows share the call, not on the kernel path (AVX512-VNNI, AVX2, portable), not
on the number of threads. The kernel gets it by construction (exact integer block sums, one float epilogue per
output in block order, threads split over output columns); tests/test_qlinear.py checks it on every path the CPU
runs. Without a kernel build the same arithmetic runs as tensor ops (``reference``): exact integer block sums, then
an elementwise epilogue in block order, so rows are still independent of each other (its last bits differ from
the kernel's: it multiplies and adds where the kernel fuses).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from spechead import kernels
from spechead.kernels.quant import BLOCK, QuantBlocks, quantize

PANEL = 16  # output columns per panel


class QuantWeight:
    """A quantized [N, K] weight in the kernel's panel layout: ``data`` uint8 [N/16, K/32, 512 | 256], ``scale``
    and ``min`` fp32 [N/16, K/32, 16] (``min`` empty for q8). One copy; ``rows`` dequantizes a few rows (an
    embedding lookup on a tied table)."""

    def __init__(self, data: Tensor, scale: Tensor, min: Tensor, rows: int) -> None:
        self.data, self.scale, self.min, self.rows = data, scale, min, rows
        self.format = "q4" if data.shape[2] == 256 else "q8"
        self.in_features = data.shape[1] * BLOCK

    @classmethod
    def empty(cls, capacity: int, in_features: int, fmt: str) -> QuantWeight:
        """Room for ``capacity`` rows, written later (``write``): a draft head's active rows."""
        np_, kb = -(-capacity // PANEL), in_features // BLOCK
        data = torch.zeros(np_, kb, 256 if fmt == "q4" else 512, dtype=torch.uint8)
        scale = torch.zeros(np_, kb, PANEL)
        return cls(data, scale, torch.zeros_like(scale) if fmt == "q4" else torch.empty(0), capacity)

    def write(self, slots: Tensor, blocks: QuantBlocks) -> None:
        """Rows ``blocks`` into row slots ``slots`` in place (one strided copy per tensor)."""
        if blocks.format != self.format:
            raise ValueError(f"cannot write {blocks.format} rows into a {self.format} weight")
        p, c = slots // PANEL, slots % PANEL
        n, kb = len(slots), self.data.shape[1]
        q = blocks.q.view(n, kb, 8, 4)
        if self.format == "q4":
            u = q.to(torch.uint8)
            self.data.view(-1, kb, 4, PANEL, 4)[p, :, :, c] = u[:, :, :4] | (u[:, :, 4:] << 4)
            self.min[p, :, c] = blocks.min
        else:
            self.data.view(-1, kb, 8, PANEL, 4)[p, :, :, c] = q.view(torch.uint8)
        self.scale[p, :, c] = blocks.scale

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.rows, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def detach(self) -> QuantWeight:
        return self

    def __getitem__(self, index: Tensor | slice) -> QuantBlocks:
        """The blocks of some rows (a head gathering its vocabulary's rows)."""
        if isinstance(index, slice):
            index = torch.arange(self.rows)[index]
        return self.blocks(index)

    @classmethod
    def pack(cls, blocks: QuantBlocks) -> QuantWeight:
        n, k = blocks.shape
        np_, kb = -(-n // PANEL), k // BLOCK
        pad = np_ * PANEL - n
        q = torch.nn.functional.pad(blocks.q, (0, 0, 0, pad)) if pad else blocks.q
        # [N, K] -> [panel, column, block, group, 4] -> [panel, block, group, column, 4]
        q = q.view(np_, PANEL, kb, 8, 4).permute(0, 2, 3, 1, 4).reshape(np_, kb, 8, PANEL * 4)
        if blocks.format == "q4":
            u = q.to(torch.uint8)
            data = (u[:, :, :4] | (u[:, :, 4:] << 4)).reshape(np_, kb, 256)
        else:
            data = q.view(torch.uint8).reshape(np_, kb, 512)

        def per_panel(t: Tensor) -> Tensor:
            t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad)) if pad else t.float()
            return t.view(np_, PANEL, kb).permute(0, 2, 1).contiguous()

        m = per_panel(blocks.min) if blocks.min is not None else torch.empty(0)
        return cls(data.contiguous(), per_panel(blocks.scale), m, n)

    def blocks(self, index: Tensor | None = None) -> QuantBlocks:
        """The blocks of rows ``index`` (all rows by default), row-major again."""
        idx = torch.arange(self.rows) if index is None else index.reshape(-1).long().cpu()
        p, c = idx // PANEL, idx % PANEL
        np_, kb = self.data.shape[:2]
        # each row's own bytes, [n, kb, groups, 4]: one gather (indexing whole panels first read 16 rows' bytes)
        if self.format == "q4":
            d = self.data.view(np_, kb, 4, PANEL, 4)[p, :, :, c]
            q = torch.cat([d & 15, d >> 4], dim=2).to(torch.int8)  # groups 0..3, then 4..7
        else:
            q = self.data.view(np_, kb, 8, PANEL, 4)[p, :, :, c].view(torch.int8)
        scale = self.scale[p, :, c]
        m = self.min[p, :, c] if self.format == "q4" else None
        return QuantBlocks(q.reshape(len(idx), -1).contiguous(), scale, m, self.format)

    def dequantize_rows(self, index: Tensor) -> Tensor:
        """fp32 rows [*index.shape, K] (an embedding lookup on the table this weight is): the kernel's ``qrows``
        where a build runs, the same values as ``blocks(index).dequantize()``."""
        if kernels.available() and index.device.type == "cpu":
            return kernels.ops().qrows(self.data, self.scale, self.min, index, self.rows)
        return self.blocks(index).dequantize().view(*index.shape, self.in_features)

    @property
    def tensors(self) -> list[Tensor]:
        """What the kernel's ops take for this weight: data, scale, min."""
        return [self.data, self.scale, self.min]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __call__(self, x: Tensor, n: int | None = None) -> Tensor:
        """x [M, K] -> fp32 [M, n] against the first n rows (default: all)."""
        n = self.rows if n is None else n
        if kernels.available() and x.device.type == "cpu":
            return kernels.ops().qlinear(x, self.data, self.scale, self.min, n)
        return self.reference(x, n)

    def reference(self, x: Tensor, n: int | None = None) -> Tensor:
        """The kernel's arithmetic as tensor ops (see the module docstring)."""
        n = self.rows if n is None else n
        m, k = x.shape
        xb = x.detach().float().reshape(m, k // BLOCK, BLOCK)
        amax = xb.abs().amax(-1)
        d = amax / 127.0
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # as the kernel
        qa = torch.round(xb * inv[..., None]).to(torch.int32)  # round half to even, as the kernel's nearbyint
        s = qa.sum(-1)
        wb = self.blocks(torch.arange(n))
        qw = wb.q.to(torch.int32).view(n, k // BLOCK, BLOCK)
        isum = torch.einsum("mbk,nbk->mnb", qa.double(), qw.double()).to(torch.int64)  # exact: |sum| < 2^53
        acc = torch.zeros(m, n)
        ds = d * s.float()
        for b in range(k // BLOCK):
            acc = acc + isum[:, :, b].float() * (wb.scale[None, :, b] * d[:, b, None])
            if wb.min is not None:
                acc = acc + wb.min[None, :, b] * ds[:, b, None]
        return acc


class QuantLinear(nn.Module):
    """A model's projection over a ``QuantWeight`` (its ``data`` / ``scale`` / ``min`` are the module's buffers,
    so the converted model saves and loads with a state dict); the result in the input's dtype."""

    def __init__(self, weight: QuantWeight, bias: Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.rows
        self.register_buffer("data", weight.data)
        self.register_buffer("scale", weight.scale)
        self.register_buffer("min", weight.min)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._layout = weight
        self._weight: Tensor | None = None

    @property
    def layout(self) -> QuantWeight:
        """The buffers as a ``QuantWeight``, built again where they were replaced since (``load_state_dict`` with
        ``assign``, ``to``)."""
        w = self._layout
        if w.data is not self.data or w.scale is not self.scale or w.min is not self.min:
            w = self._layout = QuantWeight(self.data, self.scale, self.min, self.out_features)
            self._weight = None
        return w

    @property
    def format(self) -> str:
        return self.layout.format

    @property
    def weight(self) -> Tensor:
        """The fp32 matrix the blocks stand for, made at the first read and kept (a float draft head over a
        quantized LM head reads it; the projections never do)."""
        layout = self.layout
        if self._weight is None:
            self._weight = layout.blocks().dequantize()
        return self._weight

    def on_kernel(self, x: Tensor, prefill: bool = False) -> bool:
        """Whether a call on ``x`` takes the kernel: every 2-D call where a build runs, prefill included."""
        return x.dim() == 2 and kernels.available() and x.device.type == "cpu"

    def forward(self, x: Tensor, prefill: bool = False) -> Tensor:
        shape = x.shape
        y = self.layout(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module | None], skip: tuple[str, ...] = ()) -> None:
    """Put ``make(linear)`` in place of every ``nn.Linear`` of ``model`` but those under the submodule names in
    ``skip``; a linear for which ``make`` returns None stays."""
    for name, child in list(model.named_modules()):
        if not isinstance(child, nn.Linear) or any(name == s or name.startswith(s + ".") for s in skip):
            continue
        new = make(child)
        if new is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, new)


def quantize_linears(model: nn.Module, fmt: str, skip: tuple[str, ...] = ()) -> None:
    """Swap a ``QuantLinear`` at ``fmt`` in for every ``nn.Linear`` of ``model`` (but those under ``skip``): its
    weight quantized per 32-value block (``quant.quantize``), the float weight dropped. Idempotent."""

    def make(lin: nn.Linear) -> QuantLinear | None:
        if lin.in_features % BLOCK:
            return None  # the kernel's blocks need K divisible by 32: this one stays float
        return QuantLinear(QuantWeight.pack(quantize(lin.weight.detach(), fmt)), lin.bias)

    swap_linears(model, make, skip)
