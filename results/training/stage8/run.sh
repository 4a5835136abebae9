#!/usr/bin/env bash
# Stage 8 (eighteenth session, Intel Xeon with AVX-512 and AMX, 2 cores): the EAGLE-3 drafter and its rank-72
# SlimSpec twin, untouched since stage 2 (1,000 steps on human text, held-out top-1 0.28 at the first position
# against 0.40-0.45 for the EAGLE-2 drafter after stages 3-7; chain:3 acceptance 1.32 against 1.64). This stage
# gives them what moved EAGLE-2 in stages 6-7: the target's own greedy replies (other prompts: seed 18) and the
# 3-step training-time test. Two arms at once, one thread each, the same held-out packs and recipe:
#   e3    the full-head EAGLE-3 drafter (its head tied to the target's), from spechead/drafters/eagle3
#   lr72  the rank-72 drafter trained with its low-rank head in the loop (backbone and factors together, the
#         SlimSpec way), from spechead/drafters/eagle3-lowrank72: issue 14's "rank-72 >= 0.95x its full-head
#         twin" compares it with e3, trained alike
# Acceptance as in stages 6-7 (chains of 3 and 5, the 2x4x8 tree, no lookup branch, the benchmark's held-out
# prompts, greedy, one thread each) for the shipped and the new drafters. Run from the repository root with the
# venv active:  bash results/training/stage8/run.sh gen|extract|train|heldout|accept
# Generated data and features stay outside the repository (W).
set -euo pipefail
W=${W:-/tmp/stage8}; R=results/training/stage8
mkdir -p $W $R
source results/training/stage_lib.sh  # D, drafter_at, gen_replies, extract_features, heldout_shipped, acceptance
shipped() {  # the drafters as committed before this stage, into $W/shipped_*
  drafter_at 3ddcd73 eagle3 $W/shipped_eagle3
  drafter_at 3ddcd73 eagle3-lowrank72 $W/shipped_eagle3-lowrank72
}
case "${1:?gen|extract|train|heldout|accept}" in
gen)  # prompts of the benchmark's categories (none of its prompts), greedy, fp32 target, 32 in flight
  gen_replies 18 14 ;;
extract)  # the fp32 target's three fused layers and final normed state, two one-thread workers
  extract_features eagle3 ;;
train)  # two fine-tunes at once, one thread each, the same held-out packs
  shipped
  COMMON="--features $W/feats --pack-tokens 1024 --loss-on all --eval-packs 8 --threads 1 --arch eagle3 --epochs 4
    --ce-positions 64 --ce-weight 0.5 --noise 0.1 --save-every 50 --eval-every 100 --seed 8 --quiet --ttt-steps 3
    --lr ${LR:-7e-4} --warmup 10 --max-steps ${STEPS:-700}"
  spechead train-drafter $COMMON --init $W/shipped_eagle3 --out $W/e3 > $W/e3.log 2>&1 &
  spechead train-drafter $COMMON --init $W/shipped_eagle3-lowrank72 --head lowrank:72 --out $W/lr72 > $W/lr72.log 2>&1 &
  wait
  for r in e3 lr72; do mkdir -p $R/$r; cp $W/$r/metrics.json $W/$r/train_log.jsonl $R/$r/; done ;;
heldout)  # the shipped drafters' held-out top-1 per unrolled step, on the packs the training runs report on
  shipped
  heldout_shipped 1024 eagle3 eagle3-lowrank72 ;;
accept)  # tokens committed per round, no lookup branch, held-out prompts, greedy, one thread each
  shipped
  acceptance ${DRAFTERS:-shipped_e3:$W/shipped_eagle3 e3:$W/e3 shipped_lr72:$W/shipped_eagle3-lowrank72 lr72:$W/lr72} ;;
esac
