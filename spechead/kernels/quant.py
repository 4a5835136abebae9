"""Quantized weights in 32-value blocks, the integer engine's one weight representation.

``QuantBlocks`` is a [N, K] weight as blocks of 32 consecutive values along K, each an integer vector with a float
scale (and, for 4-bit blocks, a float minimum): W[n, k] = scale[n, k // 32] * q[n, k] + min[n, k // 32]. GGUF's
Q8_0, Q4_0, Q4_1, Q5_0 and the 32-value sub-blocks of Q4_K map onto it exactly (``model.gguf``);
``quantize`` makes it from float weights. ``QuantWeight`` (``kernels.qlinear``) repacks it for the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32  # values per block along K
FORMATS = ("q8", "q4")  # int8 blocks with a scale; unsigned 4-bit blocks with a scale and a minimum


@dataclass
class QuantBlocks:
    """W[n, k] = scale[n, k // 32] * q[n, k] + min[n, k // 32] (min absent: 0).

    ``q`` is int8 [N, K]: any int8 value for ``q8``, 0..15 for ``q4``; ``scale`` and ``min`` float32 [N, K // 32]."""

    q: Tensor
    scale: Tensor
    min: Tensor | None
    format: str

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.format not in FORMATS:
            raise ValueError(f"unknown block format {self.format!r}; expected one of {', '.join(FORMATS)}")
        if k % BLOCK:
            raise ValueError(f"a quantized weight needs K divisible by {BLOCK}, got K={k}")
        if self.q.dtype != torch.int8 or self.scale.shape != (n, k // BLOCK):
            raise ValueError(f"blocks of a [{n}, {k}] weight need int8 q and [{n}, {k // BLOCK}] scales")
        if self.format == "q4" and (self.min is None or int(self.q.min()) < 0 or int(self.q.max()) > 15):
            raise ValueError("q4 blocks hold values 0..15 and a minimum per block")
        if self.format == "q8" and self.min is not None:
            raise ValueError("q8 blocks are symmetric: no minimum")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> Tensor:
        """The float32 weight the blocks stand for (scale * q + min, in fp32)."""
        n, k = self.q.shape
        w = self.q.float().view(n, k // BLOCK, BLOCK) * self.scale[..., None]
        if self.min is not None:
            w = w + self.min[..., None]
        return w.view(n, k)

    def float(self) -> Tensor:
        return self.dequantize()

    def rows(self, index: Tensor) -> QuantBlocks:
        """The blocks of the rows ``index`` (a permutation, a subset, a vocabulary's active rows)."""
        m = None if self.min is None else self.min[index]
        return QuantBlocks(self.q[index], self.scale[index], m, self.format)


def quantize(w: Tensor, fmt: str) -> QuantBlocks:
    """Blocks of 32 from a float weight [N, K]: ``q8`` symmetric (scale = max|w| / 127, round to nearest even) or
    ``q4`` with a minimum (q = round((w - min) / scale), scale = (max - min) / 15), as GGUF's Q8_0 and Q4_1 do."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"cannot quantize a [{n}, {k}] weight: K must be divisible by {BLOCK}")
    x = w.detach().float().reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8":
        scale = x.abs().amax(-1) / 127.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round(x * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return QuantBlocks(q.view(n, k), scale, None, "q8")
    if fmt == "q4":
        lo, hi = x.amin(-1), x.amax(-1)
        scale = (hi - lo) / 15.0
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        q = torch.round((x - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.int8)
        return QuantBlocks(q.view(n, k), scale, lo, "q4")
    raise ValueError(f"unknown block format {fmt!r}; expected one of {', '.join(FORMATS)}")
