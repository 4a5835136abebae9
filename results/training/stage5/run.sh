#!/usr/bin/env bash
# Stage 5 (fourteenth session, AMD EPYC Zen 3, AVX2, 2 cores): the target's own greedy replies on spechead's
# batched decoder, features, then two EAGLE-2 runs side by side on them (one thread each): a fine-tune of the
# shipped drafter and one from scratch (the recipe that gave the Gemma drafter 0.524 held-out top-1), and chain
# acceptance of the better one against the shipped drafter on held-out prompts. Run from the repository root with
# the venv active; generated data and features stay outside the repository (W).
set -euo pipefail
D=../shared/data/train; W=${W:-/tmp/stage5}; R=results/training/stage5
mkdir -p $W
# 1. gen-data: prompts of the benchmark's categories (none of its prompts), greedy, fp32, 32 in flight
timeout 32m spechead gen-data --engine spechead --batch-size 32 --max-new-tokens 192 --threads 2 --seed 15 \
  --out $W/greedy.jsonl --stop-after ${PROMPTS:-1800} \
  --data $D/chat_sharegpt.jsonl.gz:1500 $D/chat_alpacaeval.jsonl.gz:600 $D/chat_gpteacher.jsonl.gz:800 \
  $D/chat_arenahard.jsonl.gz:500 $D/code_instruct.jsonl.gz:800 $D/math_gsm8k_train.jsonl.gz:1000 $D/math_MATH.jsonl.gz:500 \
  $D/summ_t0_news.jsonl.gz:500 $D/summ_scitldr.jsonl.gz:300 $D/mt_de_en.jsonl.gz:1000 $D/qa_nq_open.jsonl.gz:600 \
  $D/qa_t0_context.jsonl.gz:600 || true
cp $W/greedy.jsonl.manifest.json $R/gen_data_manifest.json
# 2. features (fp32 target), two one-thread workers
for i in 0 1; do
  spechead extract --threads 1 --arch eagle2 --max-len 768 --chunk-tokens 16384 --features $W/feats --shard $i/2 \
    --data $W/greedy.jsonl > $W/extract$i.log 2>&1 &
done; wait
# 3. EAGLE-2, two runs at once, one thread each, the same held-out packs
COMMON="--features $W/feats --pack-tokens 1024 --loss-on all --eval-packs 8 --threads 1 --arch eagle2 --max-steps ${STEPS:-1500}
  --epochs 4 --ce-positions 128 --ce-weight 0.5 --noise 0.1 --save-every 100 --eval-every 250 --seed 5 --quiet"
spechead train-drafter $COMMON --out $W/finetune --init spechead/drafters/eagle2 --lr 5e-4 --warmup 10 > $W/finetune.log 2>&1 &
spechead train-drafter $COMMON --out $W/scratch --lr 1e-3 --warmup 50 > $W/scratch.log 2>&1 &
wait
for r in finetune scratch; do mkdir -p $R/$r; cp $W/$r/metrics.json $W/$r/train_log.jsonl $R/$r/; done
# 4. chain acceptance (tau = tokens committed per round, no lookup branch), held-out prompts, greedy, one thread each
for d in shipped:spechead/drafters/eagle2 finetune:$W/finetune scratch:$W/scratch; do
  SPECHEAD_TUNE=off spechead bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 --threads 1 \
    --no-guard --warmup 0 --methods ar,eagle@chain:1,eagle@chain:3,eagle@2x4x8 --drafter ${d#*:} \
    --json $R/acceptance_${d%%:*}.json > $W/bench_${d%%:*}.log 2>&1 &
  [ "${d%%:*}" = finetune ] && wait
done; wait
