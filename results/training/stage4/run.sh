#!/usr/bin/env bash
# Stage 4 (sixth session, CPU A, shared with the refactor's test runs): the target's own greedy replies,
# features, one EAGLE-2 fine-tune from the shipped drafter, chain acceptance before/after. Run from the
# repository root, venv active. Generated data and features stay outside the repository.
set -euo pipefail
D=../shared/data/train; W=/tmp/stage4
# 1. gen-data: 8,699 distinct prompts of the benchmark's categories (none of its prompts), greedy, bf16 weights,
#    batches of 64 sorted by prompt length; stopped after 3,008 prompts (62 min on the shared CPU), resumable
spechead gen-data --dtype bfloat16 --batch-size 64 --max-new-tokens 192 --threads 2 --seed 14 --out $W/greedy.jsonl \
  --data $D/chat_sharegpt.jsonl.gz:1500 $D/chat_alpacaeval.jsonl.gz:600 $D/chat_gpteacher.jsonl.gz:800 \
  $D/chat_arenahard.jsonl.gz:500 $D/code_instruct.jsonl.gz:800 $D/math_gsm8k_train.jsonl.gz:1000 $D/math_MATH.jsonl.gz:500 \
  $D/summ_t0_news.jsonl.gz:500 $D/summ_scitldr.jsonl.gz:300 $D/mt_de_en.jsonl.gz:1000 $D/qa_nq_open.jsonl.gz:600 \
  $D/qa_t0_context.jsonl.gz:600
# 2. features (fp32 target), two one-thread workers; stopped after chunks 0-19 (~330 k of 704 k tokens)
for i in 0 1; do
  spechead extract --threads 1 --arch eagle3 --max-len 768 --chunk-tokens 16384 --features $W/feats --shard $i/2 \
    --data $W/greedy.jsonl &
done; wait
# 3. EAGLE-2 from the shipped drafter, 1,000 steps of 1,024 tokens (about 3 epochs of the 20 chunks), one thread
spechead train-drafter --features $W/feats --pack-tokens 1024 --loss-on all --eval-packs 8 --threads 1 --arch eagle2 \
  --out $W/eagle2g --init spechead/drafters/eagle2 --seed 3 --max-steps 1000 --epochs 4 --lr 5e-4 --warmup 10 \
  --ce-positions 128 --ce-weight 0.5 --noise 0.1 --save-every 100 --eval-every 250
# 4. chain acceptance (tau = tokens committed per round) without the lookup branch, held-out prompts, greedy
for d in shipped:spechead/drafters/eagle2 eagle2g:$W/eagle2g; do
  SPECHEAD_TUNE=off spechead bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 --threads 1 \
    --no-guard --warmup 0 --methods ar,eagle@chain:1,eagle@chain:3,eagle@chain:5,eagle@2x4x8 --drafter ${d#*:} \
    --json results/training/stage4/acceptance_${d%%:*}.json
done
