#!/usr/bin/env bash
# Stage 7 (seventeenth session, Intel Xeon with AVX-512 and AMX, 2 cores): more of the target's own replies for the
# EAGLE-2 drafter, continuing from stage 6's (5d1140d, trained with the training-time test, --ttt-steps 3). Stage 6
# left the first draft position at 0.42-0.45 top-1 agreement with the target, which caps a chain of 3 near 1.8
# tokens a round; this stage asks whether new data (other prompts of the same sources: seed 17, not 16) moves it,
# and whether weighting the soft cross-entropy as much as the feature regression (--ce-weight 1.0, arm "ce1",
# against 0.5 in arm "ce05", stage 6's recipe) buys top-1 agreement. Both arms start from stage 6's weights, one
# thread each, the same held-out packs; acceptance as in stage 6 (chains of 3 and 5, the 2x4x8 tree, no lookup
# branch, the benchmark's held-out prompts). Run from the repository root with the venv active:
#   bash results/training/stage7/run.sh gen|extract|train|accept
# Generated data and features stay outside the repository (W).
set -euo pipefail
W=${W:-/tmp/stage7}; R=results/training/stage7
mkdir -p $W $R
source results/training/stage_lib.sh  # D, drafter_at, gen_replies, extract_features, acceptance
stage6_drafter() { drafter_at 5d1140d eagle2 $W/stage6; }  # the EAGLE-2 drafter stage 6 shipped
case "${1:?gen|extract|train|accept}" in
gen)  # prompts of the benchmark's categories (none of its prompts), greedy, fp32 target, 32 in flight
  gen_replies 17 20 ;;
extract)  # the fp32 target's final normed states, two one-thread workers
  extract_features eagle2 ;;
train)  # two fine-tunes of stage 6's drafter at once, one thread each, the same held-out packs
  stage6_drafter
  COMMON="--features $W/feats --pack-tokens 1024 --loss-on all --eval-packs 8 --threads 1 --arch eagle2 --epochs 4
    --ce-positions 128 --noise 0.1 --save-every 50 --eval-every 100 --seed 7 --quiet --ttt-steps 3
    --init $W/stage6 --lr 5e-4 --warmup 10 --max-steps ${STEPS:-600}"
  spechead train-drafter $COMMON --out $W/ce05 --ce-weight 0.5 > $W/ce05.log 2>&1 &
  spechead train-drafter $COMMON --out $W/ce1 --ce-weight 1.0 > $W/ce1.log 2>&1 &
  wait
  for r in ce05 ce1; do mkdir -p $R/$r; cp $W/$r/metrics.json $W/$r/train_log.jsonl $R/$r/; done ;;
accept)  # tokens committed per round, no lookup branch, held-out prompts, greedy, one thread each
  stage6_drafter
  acceptance ${DRAFTERS:-stage6:$W/stage6 ce05:$W/ce05 ce1:$W/ce1} ;;
esac
