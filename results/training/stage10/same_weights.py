"""A tiny online training run of each drafter kind (EAGLE-2 with feature noise, EAGLE-3, rank-4 EAGLE-3) on a random
target, printing the steps, parameter checksum and held-out figures: run it at two revisions to check that a change to
the training loop keeps the weights bitwise (stage 10's sync-free unroll printed the same lines as 04de051).

    SPECHEAD_KERNELS=0 .venv/bin/python results/training/stage10/same_weights.py
"""

import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from conftest import write_tiny_llama  # noqa: E402

from spechead.model.loading import load_target  # noqa: E402
from spechead.training.config import TrainConfig  # noqa: E402
from spechead.training.data import Example  # noqa: E402
from spechead.training.loop import OnlineChunks, train  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    tmp_dir = tempfile.TemporaryDirectory()  # removed when the script ends
    tmp = Path(tmp_dir.name)
    target, _ = load_target(str(write_tiny_llama(tmp / "tiny", vocab=64, layers=2)), device="cpu")
    rng = random.Random(0)
    lengths = [40, 90, 70, 120] * 12
    examples = [Example([rng.randrange(2, 64) for _ in range(n)], [i % 3 > 0 for i in range(n)]) for n in lengths]
    for arch, head in [("eagle2", "full"), ("eagle3", "full"), ("eagle3", "lowrank:4")]:
        cfg = TrainConfig(
            arch=arch, head=head, steps_ttt=3, pack_tokens=256, ce_positions=32, eval_packs=2, epochs=3,
            noise=0.1 if arch == "eagle2" else 0.0,
        )  # fmt: skip
        online = OnlineChunks(target, examples, 1024, 256, arch == "eagle3")
        m = train(target, None, tmp / f"{arch}-{head}", cfg, progress=False, online=online)
        print(arch, head, m["steps"], repr(m["param_checksum"]), m["eval"]["top1"], m["eval"]["ce"])


if __name__ == "__main__":
    main()
