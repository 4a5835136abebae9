"""CPU kernels for the draft head and the target's few-row steps (``csrc/draft_gemm.cpp``).

Every draft head ends in ``logits = h @ W.T`` with a handful of rows in h (the tree's top_k) and
thousands to 150k rows in W; a decode step and a tree verification are the same shape of product.
It should be bound by the bytes of W. On this project's CPU it was not: oneDNN's bf16 kernel ran at
~115-140 GFLOP/s at 10 rows, about 2x the bytes floor, because the CPU's bf16 dot-product instruction
has half the throughput of fp32 FMAs, and MKL's fp32 GEMM repacked the weight on every few-row call.
``draft_linear`` widens bf16 weights to fp32 in registers (one shift or mask per 16 values) and uses
FMAs, over a blocked layout of 16 outputs per 64-byte vector (``BlockedWeight``); every output is
accumulated in one fixed order, so results do not depend on the row count.

``row_topk`` is the top-k of a few vocabulary-wide rows in one streaming pass, optionally fused with
the log-softmax and a row -> id map (draft heads' top-k, NanoSpec's update over the tree's target
logits), where ``torch.topk`` and PyTorch's bf16 reductions run far below memory speed on the CPU.
``active_set_add`` is NanoSpec's set update in one op (``NanoSpecHead._append`` is the reference).

Where the kernels cannot run (no AVX-512, no compiler or ninja, another device, ``SPECHEAD_KERNELS=0``)
``BlockedWeight`` and ``PackedLinear`` fall back to ``F.linear`` / oneDNN and the heads to tensor ops.
The library is compiled on first use with torch's C++ extension tooling (10-30 s, then cached under
``~/.cache/spechead/kernels``). Measurements and design: docs/heads.md, "CPU kernels".
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

LANES = 16  # outputs per block: one 512-bit vector of fp32
SOURCE = Path(__file__).parent / "csrc" / "draft_gemm.cpp"
_state: dict[str, object] = {}


def _build_dir() -> Path:
    import hashlib

    tag = hashlib.sha1(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    root = Path(os.environ.get("SPECHEAD_CACHE", Path.home() / ".cache" / "spechead"))
    path = root / "kernels" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def available() -> bool:
    """Whether the AVX-512 kernel is usable here (compiles it on the first call)."""
    if "ok" in _state:
        return bool(_state["ok"])
    ok = False
    if os.environ.get("SPECHEAD_KERNELS", "1") == "0":
        _state["why"] = "disabled by SPECHEAD_KERNELS=0"
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX512",):
        _state["why"] = f"CPU capability {torch.backends.cpu.get_cpu_capability()}, needs AVX512"
    else:
        try:
            from torch.utils.cpp_extension import load

            load(
                name="spechead_draft_gemm",
                sources=[str(SOURCE)],
                extra_cflags=["-O3", "-mavx512f", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_dir()),
                is_python_module=False,
            )
            ok = hasattr(torch.ops.spechead, "draft_linear")
            if ok:
                _register_fakes()
        except Exception as e:  # no compiler, no ninja, a failed build: the library still works
            _state["why"] = f"build failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            warnings.warn(f"spechead: draft-GEMM kernel unavailable ({_state['why']}); using F.linear", stacklevel=2)
    _state["ok"] = ok
    return ok


def _register_fakes() -> None:
    """Output shapes of the ops for torch.compile's tracing (`--compile`): to the compiler they are opaque."""

    @torch.library.register_fake("spechead::draft_linear")
    def _draft_linear(x: Tensor, w: Tensor, blocks: int) -> Tensor:
        return x.new_empty((x.shape[0], blocks * LANES), dtype=torch.float32)

    @torch.library.register_fake("spechead::row_topk")
    def _row_topk(x: Tensor, k: int, log_softmax: bool = False, index_map: Tensor | None = None):
        return x.new_empty((x.shape[0], k), dtype=torch.float32), x.new_empty((x.shape[0], k), dtype=torch.long)


def unavailable_reason() -> str:
    available()
    return str(_state.get("why", ""))


def supports(weight: Tensor) -> bool:
    """The kernel handles CPU bf16 weights with an even number of columns and CPU fp32 weights."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.bfloat16:
        ok_shape = weight.shape[1] % 2 == 0
    else:
        ok_shape = weight.dtype == torch.float32
    return ok_shape and available()


ROW_TOPK_MAX_K = 64  # the kernel's top-k keeps a sorted buffer of k entries: meant for small k


def row_topk_supported(x: Tensor, k: int) -> bool:
    """``torch.ops.spechead.row_topk`` serves 2-D CPU rows of bf16 or fp32 (values come back in fp32), small k."""
    return (
        k <= ROW_TOPK_MAX_K
        and x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and available()
    )


class BlockedWeight:
    """``x @ W.T`` (float32 result) for a [N, K] weight held in the kernel's blocked layout, with room
    for ``capacity`` rows; rows can be rewritten in place (``write``) and a call can use only the first
    ``n`` rows. Falls back to a plain row-major copy and ``F.linear`` where the kernel is unavailable.
    """

    def __init__(self, weight: Tensor, capacity: int | None = None) -> None:
        n, k = weight.shape
        self.rows, self.in_features, self.dtype, self.device = n, k, weight.dtype, weight.device
        self.capacity = max(capacity or n, n)
        self.blocked = supports(weight)
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
        y = torch.ops.spechead.draft_linear(x, self.data, -(-n // LANES))
        return y if y.shape[1] == n else y[:, :n].contiguous()


class PackedLinear:
    """``x @ W.T`` in float32 for a weight that never changes, laid out once for the CPU's kernels.

    A draft head's product has few rows (the tree's top_k) against many, so it should be bound by the
    bytes of W. In order of preference: spechead's AVX-512 few-row kernel (``kernels.BlockedWeight``:
    1.3-1.5x the bytes floor at 10 rows in bf16 where oneDNN ran at ~2x, docs/heads.md); else oneDNN's
    packed layout (what torch.compile's CPU freezing uses; 1.1-1.7x faster than ``F.linear`` in bf16);
    else ``F.linear`` (other devices, tiny matrices, builds without oneDNN). Each keeps one copy of W.
    """

    MIN_NUMEL = 1 << 16  # below this the packed call's fixed cost outweighs the gain

    def __init__(self, weight: Tensor, batch_hint: int = 10) -> None:
        weight = weight.detach()
        self.shape, self.dtype = weight.shape, weight.dtype
        self.nbytes = weight.numel() * weight.element_size()
        self.weight: Tensor | None = None
        self.packed: Tensor | None = None
        self.blocked: BlockedWeight | None = None
        if weight.numel() >= self.MIN_NUMEL and supports(weight):
            self.blocked = BlockedWeight(weight)
            self.nbytes = self.blocked.nbytes
            return
        self.weight = weight.contiguous()  # dropped once packed: no second copy
        if weight.device.type != "cpu" or weight.numel() < self.MIN_NUMEL or not torch.backends.mkldnn.is_available():
            return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch_hint)
            x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            ref, got = F.linear(x, self.weight), self._packed_call(x, packed)
        except (RuntimeError, AttributeError, NotImplementedError):
            return
        if got.shape == ref.shape and torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2):
            self.packed, self.weight = packed, None

    @property
    def kind(self) -> str:
        """Which path serves the calls: ``kernel``, ``onednn`` or ``linear``."""
        return "kernel" if self.blocked is not None else "onednn" if self.packed is not None else "linear"

    @staticmethod
    def _packed_call(x: Tensor, packed: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    def __call__(self, x: Tensor) -> Tensor:
        if self.blocked is not None:
            return self.blocked(x)
        x = x.to(self.dtype)
        if self.packed is not None:
            return self._packed_call(x, self.packed).float()
        return F.linear(x, self.weight).float()
