"""CPU kernels for the draft head and the target's few-row steps (``csrc/``).

Every draft head ends in ``logits = h @ W.T`` with a handful of rows in h (the tree's top_k) and
thousands to 260k rows in W; a decode step and a tree verification are the same shape of product.
It should be bound by the bytes of W. Library GEMMs are not, with 1-16 rows: MKL's fp32 GEMM repacks
the weight on every few-row call, and oneDNN's bf16 kernel is compute-bound where the CPU's bf16 dot
product is slow (half the fp32 FMA rate on the AVX-512 machine) or missing (AVX2). ``draft_linear``
widens bf16 weights to fp32 in registers and uses FMAs over a blocked layout of 16 outputs per 64
bytes (``BlockedWeight``); every output is accumulated in one fixed order, so results do not depend
on the row count. ``row_topk`` is the top-k of a few vocabulary-wide rows in one streaming pass,
optionally fused with the log-softmax and a row -> id map; ``active_set_add`` is NanoSpec's set update
in one op (``NanoSpecHead._append`` is the reference).

The sources (``csrc/``: ``simd.h``, the vector operations in each instruction set; ``ops.h``, the ops'
declarations; one source per op family, ``gemm.cpp``, ``topk.cpp``, ``attention.cpp``, ``layer.cpp``;
``register.cpp``, the op schemas) are compiled once per instruction set, each build registering its ops under
its own namespace (``torch.ops.spechead_avx512``, ``spechead_avx2``, ``spechead_generic``): ``avx512`` (AVX-512F),
``avx2`` (AVX2 + FMA: every x86-64 since Haswell and Zen 1) and ``generic`` (portable C++, no
intrinsics: ARM and older x86; the compiler lowers its vector types for the host, ``-march=native``,
and the build is keyed by the host's CPU flags). The library uses the widest one the CPU runs;
``SPECHEAD_ISA`` forces a narrower one (so an AVX-512 machine tests the other paths),
``SPECHEAD_KERNELS=0`` disables them (then ``F.linear`` and tensor ops serve). Each build is compiled
for the host on first use with torch's C++ extension tooling (10-30 s, then cached under
``$SPECHEAD_CACHE/kernels/<isa>-<hash>``, the hash covering every file of ``csrc``, the flags and the
torch version). Design and measurements: docs/heads.md, "CPU kernels".
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from spechead.cache import cache_dir

LANES = 16  # outputs per block of the layout: 64 bytes of fp32


class Sources:
    """The kernel sources in ``folder``: the files compiled (``compiled``) and, as ``read_bytes()``, every
    file's name and text in name order, headers included. A build's cache key hashes those bytes, as does the
    tuner's machine fingerprint, so a change to any file rebuilds the kernels."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def files(self) -> list[Path]:
        return sorted(p for p in self.folder.iterdir() if p.suffix in (".cpp", ".h"))

    def compiled(self) -> list[Path]:
        return [p for p in self.files() if p.suffix == ".cpp"]

    def read_bytes(self) -> bytes:
        return b"".join(p.name.encode() + b"\0" + p.read_bytes() + b"\0" for p in self.files())


SOURCE = Sources(Path(__file__).parent / "csrc")
ISAS = ("avx512", "avx2", "generic")  # widest first
# -ffp-contract=off: no mul+add is fused behind the code's back, so a build's accumulation order is the code's
_COMMON_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_NATIVE = "-march=native"  # the generic build's only flag; a compiler without it gets the baseline target
_ISA_FLAGS = {
    "avx512": ["-DSPECHEAD_ISA_AVX512", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma"],
    "avx2": ["-DSPECHEAD_ISA_AVX2", "-mavx2", "-mfma", "-mf16c"],
    # portable source, code generated for the host: its vector extensions lower to the widest SIMD it has (on
    # SSE2 alone, 8-lane vectors spilled: an 8-row forward of the demo target took 727 ms against 76 ms)
    "generic": [_NATIVE],
}
_libs: dict[str, Any] = {}  # isa -> torch.ops namespace, or the reason it is unavailable (str)
_state: dict[str, Any] = {}  # the build the library uses: "isa", "ops", "why"


def host_isas() -> list[str]:
    """The builds this CPU can run, widest first (from torch's CPU capability, which honours
    ``ATEN_CPU_CAPABILITY``); ``generic`` runs everywhere."""
    cap = torch.backends.cpu.get_cpu_capability()
    isas = {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(cap, [])
    return [*isas, "generic"]


def _host_fingerprint() -> bytes:
    """What ``-march=native`` compiles for: the machine and the CPU's feature flags, so a cache shared between
    CPUs never hands one a build for another."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {platform.processor()} {flags}".encode()


def _flags(isa: str, native: bool = True) -> list[str]:
    flags = [*_COMMON_FLAGS, *_ISA_FLAGS[isa]]
    return flags if native else [f for f in flags if f != _NATIVE]


def _build_dir(isa: str, native: bool = True, sources: Sources = SOURCE, name: str = "") -> Path:
    flags = _flags(isa, native)
    host = _host_fingerprint() if _NATIVE in flags else b""
    tag = hashlib.sha1(sources.read_bytes() + " ".join(flags).encode() + torch.__version__.encode() + host)
    tag = tag.hexdigest()[:12]
    path = cache_dir() / "kernels" / f"{name + '-' if name else ''}{isa}-{tag}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def library(isa: str) -> Any:
    """The ops of one build (``torch.ops.spechead_<isa>``), compiled on first use; raises RuntimeError with
    the reason where it cannot run here. Tests use it to check every build the CPU runs in one process."""
    if isa not in ISAS:
        raise ValueError(f"unknown ISA {isa!r}; expected one of {', '.join(ISAS)}")
    if isa not in _libs:
        if isa not in host_isas():
            _libs[isa] = f"this CPU cannot run {isa} (torch reports {torch.backends.cpu.get_cpu_capability()})"
        else:
            _libs[isa] = _build(isa)
    lib = _libs[isa]
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib


def library_from(folder: Path, name: str, isa: str | None = None) -> Any:
    """The ops of another copy of the sources (``folder``: a ``csrc`` of another revision), built for ``isa``
    (default: the active build's) under the namespace ``torch.ops.<name>``, to time a kernel change against
    them in one process (``benchmarks/kernel_ab.py``). Their schemas must be the ones this checkout calls."""
    isa = isa or active_isa() or "generic"
    lib = _build(isa, Sources(Path(folder)), name)
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return lib


@contextlib.contextmanager
def using(lib: Any) -> Iterator[None]:
    """Within the block, ``ops()`` is ``lib`` (a ``library`` or ``library_from`` build) in place of the active
    build; where the kernels are off there is none to stand in for, and the library's layers do not call them."""
    if not available():
        raise RuntimeError(f"spechead kernels unavailable: {unavailable_reason()}")
    saved = _state["ops"]
    _state["ops"] = lib
    try:
        yield
    finally:
        _state["ops"] = saved


def _build(isa: str, sources: Sources = SOURCE, name: str = "") -> Any:
    tag = name
    name = name or f"spechead_{isa}"
    try:
        from torch.utils.cpp_extension import load

        def compile_(native: bool) -> None:
            load(
                name=f"{name}_kernels",
                sources=[str(p) for p in sources.compiled()],
                extra_cflags=[*_flags(isa, native), f"-DSPECHEAD_NS={name}"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_dir(isa, native, sources, tag)),
                is_python_module=False,
            )

        try:
            compile_(native=True)
        except Exception:
            if _NATIVE not in _ISA_FLAGS[isa]:
                raise
            compile_(native=False)  # a compiler without -march=native: the baseline target's code

        ops = getattr(torch.ops, name)
        if not hasattr(ops, "draft_linear"):
            return f"the {isa} build registered no ops"
    except Exception as e:  # no compiler, no ninja, a failed build: the library still works
        first = str(e).splitlines()[0] if str(e) else ""
        return f"{isa} build failed: {type(e).__name__}: {first}"
    _register_fakes(name)
    return ops


def _register_fakes(name: str) -> None:
    """Output shapes of the ops for torch.compile's tracing (``--compile``): to the compiler they are opaque."""

    @torch.library.register_fake(f"{name}::draft_linear")
    def _draft_linear(x: Tensor, w: Tensor, blocks: int) -> Tensor:
        return x.new_empty((x.shape[0], blocks * LANES), dtype=torch.float32)

    @torch.library.register_fake(f"{name}::rms_norm")
    def _rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(f"{name}::rope")
    def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake(f"{name}::row_topk")
    def _row_topk(x: Tensor, k: int, log_softmax: bool = False, index_map: Tensor | None = None):
        return x.new_empty((x.shape[0], k), dtype=torch.float32), x.new_empty((x.shape[0], k), dtype=torch.long)


def _select() -> None:
    """Pick the build the library uses: the widest the CPU runs, or ``SPECHEAD_ISA`` if narrower."""
    if os.environ.get("SPECHEAD_KERNELS", "1") == "0":
        _state.update(isa=None, ops=None, why="disabled by SPECHEAD_KERNELS=0")
        return
    runnable = host_isas()
    want = os.environ.get("SPECHEAD_ISA", "").strip().lower() or runnable[0]
    if want not in ISAS:
        raise ValueError(f"SPECHEAD_ISA={want!r}: expected one of {', '.join(ISAS)}")
    if want not in runnable:
        msg = f"spechead: SPECHEAD_ISA={want} but this CPU runs {', '.join(runnable)}; using {runnable[0]}"
        warnings.warn(msg, stacklevel=3)
        want = runnable[0]
    reasons = []
    for isa in runnable[runnable.index(want) :]:  # a failed build falls back to the next narrower one
        try:
            _state.update(isa=isa, ops=library(isa), why="")
            if reasons:
                warnings.warn(f"spechead: {'; '.join(reasons)}; using the {isa} kernels", stacklevel=3)
            return
        except RuntimeError as e:
            reasons.append(str(e))
    _state.update(isa=None, ops=None, why="; ".join(reasons))
    warnings.warn(f"spechead: CPU kernels unavailable ({_state['why']}); using F.linear", stacklevel=3)


def active_isa() -> str | None:
    """The build the library uses (``avx512``, ``avx2``, ``generic``), None when the kernels are off."""
    if "isa" not in _state:
        _select()
    return _state["isa"]


def available() -> bool:
    """Whether a kernel build is usable here (compiles it on the first call)."""
    return active_isa() is not None


def unavailable_reason() -> str:
    active_isa()
    return str(_state.get("why", ""))


def ops() -> Any:
    """The active build's op namespace (``torch.ops.spechead_<isa>``); only valid when ``available()``."""
    if active_isa() is None:
        raise RuntimeError(f"spechead kernels unavailable: {unavailable_reason()}")
    return _state["ops"]


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
    """``row_topk`` serves 2-D CPU rows of bf16 or fp32 (values come back in fp32), small k."""
    return (
        k <= ROW_TOPK_MAX_K
        and x.dim() == 2
        and x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and available()
    )


def row_topk(x: Tensor, k: int, log_softmax: bool = False, index_map: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Top-k values (fp32, descending; log-probabilities with ``log_softmax``) and indices (through
    ``index_map`` when given) of each row of a contiguous 2-D CPU tensor, in one pass per row."""
    return ops().row_topk(x, k, log_softmax, index_map)


def test_paths() -> list[str]:
    """Environment settings that run the test suite on every kernel path this CPU can take: each build,
    widest first, then none (``make test`` runs the suite once per entry)."""
    return [f"SPECHEAD_ISA={isa}" for isa in host_isas()] + ["SPECHEAD_KERNELS=0"]
