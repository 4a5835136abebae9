"""Rehearse stage 9's device paths on a tiny random Llama in seconds (first on the lent GPU, before its long run):
transformers' generate through gen-data's engine, and train-drafter's online, timed loop for EAGLE-2, EAGLE-3 and a
low-rank EAGLE-3 drafter on ``--device``.   python results/training/stage9/smoke.py --device cuda
"""

import argparse
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

from conftest import write_tiny_llama  # noqa: E402

from spechead.model import tokenizer  # noqa: E402
from spechead.model.loading import load_target  # noqa: E402
from spechead.training.config import TrainConfig  # noqa: E402
from spechead.training.data import Example, _transformers_replies  # noqa: E402
from spechead.training.loop import OnlineChunks, train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    tmp_dir = tempfile.TemporaryDirectory()  # removed when the script ends
    tmp = Path(tmp_dir.name)
    folder = write_tiny_llama(tmp / "tiny", vocab=64, layers=2)
    tokenizer.load_tokenizer = lambda _: SimpleNamespace(pad_token_id=0)  # the tiny model has no tokenizer
    replies = list(_transformers_replies(folder, "float32", [[3, 4, 5], [6, 7]], 2, 8, 0.0, 0, [1], args.device))
    print("generate:", [len(r[0]) for r in replies])
    target, _ = load_target(str(folder), device=args.device)
    rng = random.Random(0)
    examples = [Example([rng.randrange(2, 64) for _ in range(n)], [True] * n) for n in [40, 90, 70, 120] * 12]
    for arch, head in [("eagle2", "full"), ("eagle3", "full"), ("eagle3", "lowrank:4")]:
        cfg = TrainConfig(arch=arch, head=head, steps_ttt=3, pack_tokens=256, ce_positions=32, eval_packs=2, epochs=50)
        online = OnlineChunks(target, examples, 1024, 256, arch == "eagle3")
        m = train(target, None, tmp / f"{arch}-{head}", cfg, progress=False, online=online, max_minutes=0.05)
        print(arch, head, "steps", m["steps"], "top1", [round(x, 3) for x in m["eval"]["top1"]])
    print("smoke ok on", args.device)


if __name__ == "__main__":
    main()
