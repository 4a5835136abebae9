"""The GPU check (run it first on a machine with a GPU; CI has none): spechead's device-agnostic paths on CUDA.

1. Lossless decoding on the GPU: a tiny random Llama target and random EAGLE-2 / EAGLE-3 drafters on the device,
   every draft head, a tree with the lookup branch: speculative greedy output, and seeded sampled output, equal the
   device's own AR output.
2. Drafter training there: the skip-on-CPU tests of ``train-drafter --online`` and ``extract --device`` on the device.

    python benchmarks/gpu_check.py --device cuda      (about a minute; --device cpu rehearses it anywhere)

Prints one line per drafter architecture and head (lossless or MISMATCH), pytest's summary, then
"GPU check: passed" (exit status 0) or what failed (exit status 1).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import write_tiny_llama  # noqa: E402

from spechead.decoding.decoder import Decoder  # noqa: E402
from spechead.decoding.sampling import SamplingConfig  # noqa: E402
from spechead.decoding.tree import TreeConfig  # noqa: E402
from spechead.errors import SpecheadError  # noqa: E402
from spechead.heads.base import make_head  # noqa: E402
from spechead.model.drafter import random_drafter  # noqa: E402
from spechead.model.loading import load_target  # noqa: E402

HEADS = ["full", "nanospec:8", "lowrank:4", "hybrid"]


def lossless(device: str) -> int:
    folder = write_tiny_llama(Path(tempfile.mkdtemp()) / "tiny16", vocab=16, layers=2, std=0.5, seed=1)
    target, _ = load_target(str(folder), device=device)
    failures = 0
    for arch in ("eagle2", "eagle3"):
        drafter = random_drafter(target, arch, seed=0).to(device)
        w, ids = drafter.head_weight(target)
        for spec in HEADS:
            try:
                head = make_head(spec, w, ids, target.config.vocab_size)
            except SpecheadError as e:  # a head this vocabulary cannot take is reported, not hidden
                print(f"{arch} {spec}: not built here ({type(e).__name__}: {e})")
                continue
            dec = Decoder(target, drafter, head, TreeConfig.parse("2x2x5+lookup:4"), 160, None, None)
            g = torch.Generator().manual_seed(3)
            same, longest = True, 0
            for i in range(4):
                prompt = torch.randint(0, 16, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g)
                ar, spec_out = dec.generate(prompt, 48, speculative=False), dec.generate(prompt, 48)
                same &= ar.tokens == spec_out.tokens
                longest = max(longest, max(spec_out.accept_lengths))
                hot = SamplingConfig(1.0, top_p=0.95, seed=i)  # seeded sampling: the device generator's draws
                same &= dec.generate(prompt, 48, hot, speculative=False).tokens == dec.generate(prompt, 48, hot).tokens
            failures += not same
            print(f"{arch} {spec}: {'lossless' if same else 'MISMATCH'} on {device}, longest round {longest}")
    return failures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch")
    print("torch", torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    failures = lossless(args.device)
    tests = ["tests/test_train.py::test_online_training_on_a_gpu", "tests/test_train.py::test_extract_on_a_device"]
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests], cwd=ROOT)
    verdict = "passed" if failures == 0 and rc == 0 else f"FAILED ({failures} decode mismatches, pytest {rc})"
    print("GPU check:", verdict)
    sys.exit(1 if failures or rc else 0)


if __name__ == "__main__":
    main()
