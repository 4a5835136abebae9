#!/usr/bin/env bash
# Stage 12 (twenty-seventh session, CPU C: AMD EPYC Zen 4, 2 cores; no GPU lent, so stage 11's device run stays
# prepared): stage 8's CPU recipe once more, on replies no drafter has seen. Greedy replies of the fp32 target to
# prompts no earlier stage answered (stage 11's prompts11, another seed), the EAGLE-3 features of those replies (the
# final state EAGLE-2 reads is among them), then two arms at once, one thread each, from the shipped (stage 10)
# weights, the same held-out packs:
#   e2    the EAGLE-2 drafter, the one `eagle`, `nanospec` and the demo decode with
#   lr72  the rank-72 SlimSpec drafter, backbone and factors together (stage 8's way)
# Acceptance as in stages 6-10 (chains of 3 and 5, the 2x4x8 tree, no lookup branch, the benchmark's held-out
# prompts, greedy, one thread each). Run from the repository root with the venv active:
#   bash results/training/stage12/run.sh gen|extract|train|heldout|accept
# PROMPTS=.gpu/prompts11.jsonl.gz (built by results/training/stage11/unused_prompts.py, see stage11/gpu.sh).
# Outcome (docs/training.md, stage 12): held-out top-1 level with the shipped drafters after 300 steps; not shipped,
# accept not run. Run as: gen; extract; TRAIN_MIN=45 train (stopped at 34 min); heldout with --pack-tokens 2048.
set -euo pipefail
W=${W:-/tmp/stage12}; R=results/training/stage12
mkdir -p $W $R
source results/training/stage_lib.sh  # D, drafter_at, extract_features, heldout_shipped, acceptance
BASE=fd4bca7  # the drafters as shipped before this stage (stage 10's)
shipped() {
  drafter_at $BASE eagle2 $W/shipped_eagle2
  drafter_at $BASE eagle3-lowrank72 $W/shipped_eagle3-lowrank72
}
case "${1:?gen|extract|train|heldout|accept}" in
gen)  # greedy, fp32 target, 32 in flight on spechead's batched decoder, stopped by the clock
  timeout ${GEN_MIN:-18}m spechead gen-data --engine spechead --batch-size 32 --max-new-tokens 192 --threads 2 \
    --seed 27 --out $W/greedy.jsonl --data ${PROMPTS:-.gpu/prompts11.jsonl.gz} || true
  python results/training/whole_records.py $W/greedy.jsonl
  cp $W/greedy.jsonl.manifest.json $R/gen_data_manifest.json ;;
extract)  # the fp32 target's three fused layers and final normed state, two one-thread workers
  extract_features eagle3 ;;
train)  # two fine-tunes at once, one thread each, the same held-out packs
  shipped
  # gentler than stage 8's (lr 7e-4, warmup 10, 64 CE positions in packs of 1,024): from stage 10's drafters
  # that recipe lost held-out top-1 at once (EAGLE-2 0.448 -> 0.390 by step 100, rank-72 0.311 -> 0.263; the
  # first try's logs are in $W/try1), so a smaller rate, a longer warm-up and 4x the CE positions a step
  COMMON="--features $W/feats --pack-tokens ${PACK:-2048} --loss-on all --eval-packs 8 --threads 1 --epochs 4
    --ce-positions ${CE:-256} --ce-weight 0.5 --noise 0.1 --save-every 50 --eval-every 50 --seed 12 --quiet
    --ttt-steps 3 --lr ${LR:-1e-4} --warmup ${WARMUP:-50} --max-minutes ${TRAIN_MIN:-45} --max-steps ${STEPS:-100000}"
  spechead train-drafter $COMMON --arch eagle2 --init $W/shipped_eagle2 --out $W/e2 > $W/e2.log 2>&1 &
  spechead train-drafter $COMMON --arch eagle3 --init $W/shipped_eagle3-lowrank72 --head lowrank:72 \
    --lowrank-teacher target --out $W/lr72 > $W/lr72.log 2>&1 &
  wait
  for r in e2 lr72; do mkdir -p $R/$r; cp $W/$r/metrics.json $W/$r/train_log.jsonl $R/$r/; done ;;
heldout)  # the shipped drafters' held-out top-1 per unrolled step, on the packs the training runs report on
  shipped
  heldout_shipped ${PACK:-2048} eagle2 eagle3-lowrank72 ;;
accept)  # tokens committed per round, no lookup branch, held-out prompts, greedy, one thread each
  shipped
  acceptance ${DRAFTERS:-e2:$W/e2 lr72:$W/lr72} ;;
esac
