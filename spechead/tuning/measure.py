"""Measurement primitives shared by the tuner and the benchmarks: medians, bandwidth, CPU facts."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


# -- the machine ---------------------------------------------------------------------------------
def llc_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
    except (OSError, ValueError):
        return 64 * 2**20


def cpuinfo_field(key: str) -> str | None:
    """The first core's ``key`` in /proc/cpuinfo ("model name", "cpu MHz", "flags"), or None where it is absent."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_mhz() -> tuple[float, str] | None:
    """The core clock a compute peak is taken at, with where it comes from: lscpu's "CPU max MHz" where it reports
    one, else the first core's "cpu MHz" in /proc/cpuinfo (None where neither says)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "CPU max MHz" and _positive(value):
            return float(value), "lscpu CPU max MHz"
    mhz = cpuinfo_field("cpu MHz")
    if mhz is not None and _positive(mhz):
        return float(mhz), "/proc/cpuinfo cpu MHz of the first core"
    return None


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def machine_facts(threads: int) -> dict[str, object]:
    """What a benchmark's JSON says of the machine it ran on: CPU, torch's capability, threads, load."""
    return {
        "cpu": cpu_name(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "loadavg": os.getloadavg(),
    }


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


class CopyMeter:
    """The machine's copy bandwidth (bytes read + bytes written per second of a large tensor copy).

    Sampled once at the start and again inside every repeat, next to the heads: on a shared machine the
    bandwidth a run gets drifts, and a floor must be computed under the same conditions as the timing.
    """

    def __init__(self, nbytes: int = 256 * 2**20) -> None:
        self.src = torch.ones(nbytes // 4)
        self.dst = torch.empty_like(self.src)
        self.nbytes = nbytes
        self.samples: list[float] = []

    def sample(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        gbps = 2 * self.nbytes / (time.perf_counter() - t0) / 1e9
        self.samples.append(gbps)
        return gbps

    def start(self, repeats: int = 7) -> dict[str, float]:
        self.sample()
        copy = statistics.median(self.sample() for _ in range(repeats))
        read = self.nbytes / median_ms(lambda: self.src.sum(), repeats) / 1e6
        self.samples.clear()
        return {"copy_GBps": copy, "read_GBps": read, "buffer_MB": self.nbytes / 2**20}

    def median(self) -> float:
        return statistics.median(self.samples)
