"""Gemma 3 270M's GGUF: one parse, then a whole conversion (which now parses once), timed.

.venv/bin/python results/bench/zen3/gguf_conversion.py
"""

import tempfile
import time
from pathlib import Path

import gguf

from spechead.model.loading import PACKAGED_TARGETS, convert_gguf

with tempfile.TemporaryDirectory() as d:
    path = PACKAGED_TARGETS["gemma3-270m"].gguf_path(Path(d))
    t0 = time.perf_counter()
    gguf.GGUFReader(path)
    parse = time.perf_counter() - t0
    t0 = time.perf_counter()
    convert_gguf(path, Path(d) / "out")
    conv = time.perf_counter() - t0
    print(f"one GGUFReader parse {parse:.1f} s; conversion (one parse) {conv:.1f} s")
    print(f"before (three parses): about {conv + 2 * parse:.1f} s")
