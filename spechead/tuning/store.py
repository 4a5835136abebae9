"""The tuning cache: what identifies a tuning (machine, target, drafter, head, threads) and its JSON file.

A cached tuning is valid only for the costs it measured, so its key covers everything that changes them:
the CPU and the kernel build in use, the checkpoint files (by path, size and mtime), the head and threads.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from spechead.cache import cache_dir
from spechead.errors import say_once

# part of every cache key: raised whenever what a tuning measures or how the engine runs changes its costs, so that
# older cached tunings are measured again rather than read
TUNE_VERSION = 4
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def fingerprint() -> dict[str, Any]:
    """What makes this machine's costs this machine's: CPU, cores, torch, ISA, spechead's kernel."""
    from spechead import kernels
    from spechead.tuning.measure import cpu_name

    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        kernel_source = hashlib.sha1(kernels.SOURCE.read_bytes()).hexdigest()[:12]
    except OSError:
        kernel_source = None
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "affinity": affinity,
        "machine": platform.machine(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "SPECHEAD_ISA": os.environ.get("SPECHEAD_ISA"),
        "SPECHEAD_KERNELS": os.environ.get("SPECHEAD_KERNELS"),
        "kernel": kernels.active_isa(),  # the build in use (a failed build falls back to a narrower one)
        "kernel_source": kernel_source,
    }


def file_stats(path: Path) -> list[Any]:
    """(path, size, mtime) of a checkpoint's config and weight files."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(
            f for f in path.iterdir() if f.is_file() and (f.suffix in WEIGHT_SUFFIXES or f.name == "config.json")
        )
    else:
        return [str(path), "missing"]
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def target_identity(session) -> dict[str, Any]:
    """The target by its files, dtype, device and compilation (each changes the costs)."""
    target = session.target
    w = target.model.norm.weight
    return {
        "files": file_stats(session.folder),
        "dtype": target.precision,
        "device": str(w.device),
        "compiled": getattr(target, "_compiled_call_impl", None) is not None,
    }


def drafter_identity(drafter) -> dict[str, Any]:
    """By the checkpoint's files (``session.resolve_drafter`` tags where a drafter came from), the name for a
    seeded random drafter, else a digest of its weights."""
    out: dict[str, Any] = {"arch": drafter.arch, "class": type(drafter).__name__}
    source = getattr(drafter, "spechead_source", None)
    if source is None:
        h = hashlib.sha1()
        for name, t in sorted(drafter.checkpoint_state().items()):
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out["digest"] = h.hexdigest()
    else:
        out["source"] = source
        if not source.startswith("random"):
            out["files"] = file_stats(Path(source))
    return out


def cache_key(session, drafter, head: str, threads: int) -> tuple[str, dict[str, Any]]:
    """The key (a digest) and what it digests, which the cache file keeps for ``--show``."""
    meta = {
        "version": TUNE_VERSION,
        "machine": fingerprint(),
        "target": target_identity(session),
        "drafter": drafter_identity(drafter),
        "head": head,
        "threads": threads,
    }
    key = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return key, meta


def cache_path(key: str, head: str) -> Path:
    return cache_dir() / "tune" / f"{re.sub(r'[^A-Za-z0-9]+', '_', head).strip('_')}-{key}.json"


def read_record(path: Path) -> dict[str, Any] | None:
    """The cached record, or None (absent or unreadable: tune again rather than fail)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        say_once(f"spechead: ignoring an unreadable tuning cache {path} ({e}); tuning again")
        return None
    return data if isinstance(data, dict) else None


def write_record(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x
