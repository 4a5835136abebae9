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
# venv active:  bash results/training/stage8/run.sh gen|extract|train|accept
# Generated data and features stay outside the repository (W).
set -euo pipefail
D=../shared/data/train; W=${W:-/tmp/stage8}; R=results/training/stage8
mkdir -p $W $R
shipped() {  # the drafters as committed before this stage (at 3ddcd73, before this stage), into $W/shipped_*
  for d in eagle3 eagle3-lowrank72; do
    mkdir -p $W/shipped_$d
    for f in $(git ls-tree --name-only 3ddcd73 spechead/drafters/$d/); do
      git show 3ddcd73:$f > $W/shipped_$d/$(basename $f)
    done
  done
}
case "${1:?gen|extract|train|accept}" in
gen)  # prompts of the benchmark's categories (none of its prompts), greedy, fp32 target, 32 in flight
  timeout ${GEN_MIN:-14}m spechead gen-data --engine spechead --batch-size 32 --max-new-tokens 192 --threads 2 \
    --seed 18 --out $W/greedy.jsonl --stop-after ${PROMPTS:-2400} \
    --data $D/chat_sharegpt.jsonl.gz:1500 $D/chat_alpacaeval.jsonl.gz:600 $D/chat_gpteacher.jsonl.gz:800 \
    $D/chat_arenahard.jsonl.gz:500 $D/code_instruct.jsonl.gz:800 $D/math_gsm8k_train.jsonl.gz:1000 \
    $D/math_MATH.jsonl.gz:500 $D/summ_t0_news.jsonl.gz:500 $D/summ_scitldr.jsonl.gz:300 $D/mt_de_en.jsonl.gz:1000 \
    $D/qa_nq_open.jsonl.gz:600 $D/qa_t0_context.jsonl.gz:600 || true
  cp $W/greedy.jsonl.manifest.json $R/gen_data_manifest.json ;;
extract)  # the fp32 target's three fused layers and final normed state, two one-thread workers
  for i in 0 1; do
    spechead extract --threads 1 --arch eagle3 --max-len 768 --chunk-tokens 16384 --features $W/feats --shard $i/2 \
      --data $W/greedy.jsonl > $W/extract$i.log 2>&1 &
  done; wait ;;
train)  # two fine-tunes at once, one thread each, the same held-out packs
  shipped
  COMMON="--features $W/feats --pack-tokens 1024 --loss-on all --eval-packs 8 --threads 1 --arch eagle3 --epochs 4
    --ce-positions 64 --ce-weight 0.5 --noise 0.1 --save-every 50 --eval-every 100 --seed 8 --quiet --ttt-steps 3
    --lr ${LR:-7e-4} --warmup 10 --max-steps ${STEPS:-700}"
  spechead train-drafter $COMMON --init $W/shipped_eagle3 --out $W/e3 > $W/e3.log 2>&1 &
  spechead train-drafter $COMMON --init $W/shipped_eagle3-lowrank72 --head lowrank:72 --out $W/lr72 > $W/lr72.log 2>&1 &
  wait
  for r in e3 lr72; do mkdir -p $R/$r; cp $W/$r/metrics.json $W/$r/train_log.jsonl $R/$r/; done ;;
accept)  # tokens committed per round, no lookup branch, held-out prompts, greedy, one thread each
  shipped
  for d in ${DRAFTERS:-shipped_e3:$W/shipped_eagle3 e3:$W/e3 shipped_lr72:$W/shipped_eagle3-lowrank72 lr72:$W/lr72}; do
    SPECHEAD_TUNE=off spechead bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 \
      --threads 1 --no-guard --warmup 0 --methods ar,eagle@chain:3,eagle@chain:5,eagle@2x4x8 \
      --drafter ${d#*:} --json $R/acceptance_${d%%:*}.json > $W/bench_${d%%:*}.log 2>&1 &
    [ "$(jobs -r | wc -l)" -ge 2 ] && wait -n
  done; wait ;;
esac
