"""Held-out agreement of a drafter at each unrolled step, on a training run's own held-out packs (the same
packs ``train-drafter --eval-every`` reports on), so a shipped drafter can be read on the scale of a run.

    python results/training/stage6/heldout.py --features /tmp/stage6/feats --drafter spechead/drafters/eagle2 \
        --ttt-steps 5 --eval-packs 8 --pack-tokens 1024
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from spechead.model.drafter import load_drafter
from spechead.model.layers import Rotary
from spechead.model.loading import load_target
from spechead.training.config import TrainConfig
from spechead.training.features import feature_chunks
from spechead.training.loop import ChunkCache, evaluate, plan_packs, split_packs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--ttt-steps", type=int, default=5)
    ap.add_argument("--eval-packs", type=int, default=8)
    ap.add_argument("--pack-tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    target, _ = load_target("demo")
    feats = Path(a.features)
    paths = feature_chunks(feats)
    meta = json.loads((feats / "meta.json").read_text())
    _, held = split_packs(plan_packs(meta["lengths"], a.pack_tokens), len(paths), a.eval_packs)
    drafter = load_drafter(a.drafter, target).float().eval()
    drafter.rotary = Rotary(drafter.config.head_dim, 8192, drafter.config.rope_theta, drafter.config.rope_scaling)
    drafter.layer.self_attn.cache = None
    cfg = TrainConfig(arch=drafter.arch, steps_ttt=a.ttt_steps, pack_tokens=a.pack_tokens, eval_packs=a.eval_packs)
    print(json.dumps({"drafter": a.drafter, "eval": evaluate(drafter, target, ChunkCache(paths), held, cfg)}))


if __name__ == "__main__":
    main()
