"""Two kernel sources built side by side for one ISA, each under its own op namespace, so one process can time
them interleaved: the source at a git revision (``base``) and the working tree's (``new``)."""

import os
import subprocess
import tempfile

import torch
from torch.utils.cpp_extension import load

from spechead.kernels import _COMMON_FLAGS, _ISA_FLAGS, SOURCE


def build_pair(base: str, isa: str, prefix: str) -> dict:
    """{"base": ops, "new": ops} (``torch.ops.<prefix>_base`` / ``_new``), built in a fresh temporary folder."""
    work = tempfile.mkdtemp(prefix=f"spechead-{prefix}-")
    base_src = os.path.join(work, "base.cpp")
    with open(base_src, "w") as f:
        f.write(subprocess.check_output(["git", "show", f"{base}:spechead/kernels/csrc/draft_gemm.cpp"], text=True))
    libs = {}
    for tag, src in (("base", base_src), ("new", str(SOURCE))):
        os.makedirs(os.path.join(work, tag))
        load(
            name=f"{prefix}_{tag}",
            sources=[src],
            extra_cflags=[*_COMMON_FLAGS, *_ISA_FLAGS[isa], f"-DSPECHEAD_NS={prefix}_{tag}"],
            extra_ldflags=["-fopenmp"],
            build_directory=os.path.join(work, tag),
            is_python_module=False,
        )
        libs[tag] = getattr(torch.ops, f"{prefix}_{tag}")
    return libs
