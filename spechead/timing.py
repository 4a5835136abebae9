"""Wall time per named phase, the one clock the decoder, the heads and the benchmarks read."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class Timers:
    """Accumulated wall time per named phase (synchronising CUDA so the numbers are real)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str, device: torch.device | None = None):
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if device is not None and device.type == "cuda":
                torch.cuda.synchronize(device)
            self.ms[name] += (time.perf_counter() - t0) * 1e3
            self.calls[name] += 1

    def reset(self) -> None:
        self.ms.clear()
        self.calls.clear()
