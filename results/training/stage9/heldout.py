"""Held-out agreement per unrolled step of several drafters on stage 9's held-out packs (the packs the GPU runs
reported on: the last 8 packs of the last chunk of the replies, as ``train-drafter --online`` cut them), on the CPU
and the fp32 target, so the shipped drafters and the new ones are read on one scale.

    .venv/bin/python results/training/stage9/heldout.py --data /tmp/s9r/greedy.jsonl.gz \\
        --drafters shipped_e2=spechead/drafters/eagle2 e2=/tmp/s9r/e2 ... > results/training/stage9/heldout.json
"""

from __future__ import annotations

import argparse
import json

import torch

from spechead.model.drafter import load_drafter
from spechead.model.loading import load_target
from spechead.model.tokenizer import load_tokenizer
from spechead.training.config import TrainConfig
from spechead.training.data import load_examples
from spechead.training.loop import OnlineChunks, evaluate, plan_packs, split_packs, unroll_ready


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--drafters", nargs="+", required=True, help="NAME=FOLDER")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, folder = load_target("demo")
    examples = load_examples(load_tokenizer(folder), [a.data], max_len=1024, seed=9)  # gpu.sh's settings
    online = OnlineChunks(target, examples, 262144, 4096, True)
    meta = online.meta()
    _, held = split_packs(plan_packs(meta["lengths"], 4096), meta["chunks"], 8)
    out = {"data": a.data, "examples": meta["examples"], "tokens": meta["tokens"], "held_packs": len(held)}
    for spec in a.drafters:
        name, _, path = spec.partition("=")
        drafter = load_drafter(path, target).float().eval()
        unroll_ready(drafter)
        cfg = TrainConfig(arch=drafter.arch, steps_ttt=3, pack_tokens=4096, eval_packs=8)
        with torch.inference_mode():
            out[name] = {"drafter": path, **evaluate(drafter, target, online, held, cfg)}
        print(name, [round(x, 3) for x in out[name]["top1"]], flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
