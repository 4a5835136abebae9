"""Held-out agreement of a drafter with the target at each unrolled step, on a training run's own held-out packs
(the same packs ``train-drafter --eval-every`` reports on), so a shipped drafter can be read on the scale of a run.
Prints one JSON object: the drafter and, per unrolled step, its top-1 / top-k agreement and cross-entropy.

    .venv/bin/python benchmarks/drafter_heldout.py --features FEATURES --drafter spechead/drafters/eagle2 \
        --ttt-steps 3 --eval-packs 8 --pack-tokens 2048
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from spechead.model.drafter import load_drafter
from spechead.model.loading import load_target
from spechead.training.config import TrainConfig
from spechead.training.loop import ChunkCache, evaluate, plan_packs, ready_features, split_packs, unroll_ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--features", required=True, help="a feature folder written by `spechead extract`")
    ap.add_argument("--drafter", required=True, help="a drafter folder")
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--eval-packs", type=int, default=8)
    ap.add_argument("--pack-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, _ = load_target("demo")
    paths, meta = ready_features(Path(a.features))
    _, held = split_packs(plan_packs(meta["lengths"], a.pack_tokens), len(paths), a.eval_packs)
    drafter = load_drafter(a.drafter, target).float().eval()
    unroll_ready(drafter)
    cfg = TrainConfig(arch=drafter.arch, steps_ttt=a.ttt_steps, pack_tokens=a.pack_tokens, eval_packs=a.eval_packs)
    print(json.dumps({"drafter": a.drafter, "eval": evaluate(drafter, target, ChunkCache(paths), held, cfg)}))


if __name__ == "__main__":
    main()
