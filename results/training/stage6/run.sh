#!/usr/bin/env bash
# Stage 6 (sixteenth session, AMD EPYC Zen 3, AVX2, 2 cores): EAGLE-2 trained with the training-time test.
# The shipped EAGLE-2 drafter was trained one step deep (teacher features in, next feature out), and its chain
# acceptance collapses after the first token: chain:1 commits 1.42 tokens a round (p1 = 0.42) but chain:3 only
# 1.56, a conditional acceptance of about 0.3 at depths 2-3, where it drafts from its own predicted features.
# This stage fine-tunes it with the unroll the EAGLE-3 objective uses (--ttt-steps 3 and 5: step i feeds the
# drafter's own step-(i-1) output) on new target-generated replies, and measures chain acceptance at 3 and 5 (depth by depth)
# and the 2x4x8 tree without the lookup branch on the benchmark's held-out prompts. Stage 5 (the same recipe one
# step deep, on data of the same sources) is the control. Run from the repository root with the venv active:
#   bash results/training/stage6/run.sh gen|extract|train|accept|e2e
# Generated data and features stay outside the repository (W). "shipped" / "old" is the stage-3 drafter this stage
# replaced, read back from git (old_drafter).
set -euo pipefail
W=${W:-/tmp/stage6}; R=results/training/stage6
mkdir -p $W $R
source results/training/stage_lib.sh  # D, drafter_at, gen_replies, extract_features, acceptance
old_drafter() { drafter_at 127f441 eagle2 $W/old_eagle2; }  # the EAGLE-2 drafter shipped before this stage
case "${1:?gen|extract|train|accept|e2e}" in
gen)  # prompts of the benchmark's categories (none of its prompts), greedy, fp32 target, 32 in flight
  gen_replies 16 22 ;;
extract)  # the fp32 target's final normed states, two one-thread workers
  extract_features eagle2 ;;
train)  # two fine-tunes of the shipped drafter at once, one thread each, the same held-out packs
  COMMON="--features $W/feats --pack-tokens 1024 --loss-on all --eval-packs 8 --threads 1 --arch eagle2 --epochs 4
    --ce-positions 128 --ce-weight 0.5 --noise 0.1 --save-every 50 --eval-every 100 --seed 6 --quiet
    --init spechead/drafters/eagle2 --lr 5e-4 --warmup 10"
  spechead train-drafter $COMMON --out $W/ttt3 --ttt-steps 3 --max-steps ${STEPS3:-600} > $W/ttt3.log 2>&1 &
  spechead train-drafter $COMMON --out $W/ttt5 --ttt-steps 5 --max-steps ${STEPS5:-360} > $W/ttt5.log 2>&1 &
  wait
  for r in ttt3 ttt5; do mkdir -p $R/$r; cp $W/$r/metrics.json $W/$r/train_log.jsonl $R/$r/; done ;;
accept)  # tokens committed per round, no lookup branch, held-out prompts, greedy, one thread each
  old_drafter
  acceptance ${DRAFTERS:-shipped:$W/old_eagle2 ttt3:$W/ttt3 ttt5:$W/ttt5} ;;
e2e)  # the tree tuned on this host, lookup branch on, both threads: the new drafter, then the one it replaced
  old_drafter
  for d in new:spechead/drafters/eagle2 old:$W/old_eagle2; do
    SPECHEAD_TUNE=off spechead bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 \
      --threads 2 --tree 1x0x2+lookup:8 --methods ar,eagle,nanospec --drafter ${d#*:} --json $R/e2e_${d%%:*}.json
  done ;;
esac
