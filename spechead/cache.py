"""Where spechead keeps what it builds once per machine: converted targets, kernels, tuning results."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("SPECHEAD_CACHE", Path.home() / ".cache" / "spechead"))
