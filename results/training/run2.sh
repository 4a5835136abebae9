#!/usr/bin/env bash
# Stage 2 (second session, quiet 2-core CPU): more features, longer training, the drafters shipped now.
# Starts from stage 1's checkpoints (results/training/run.sh). Run from the repository root, venv active.
set -euo pipefail
source "$(dirname "$0")/data_mix.sh"  # D, DATA
F=/tmp/run/feats
COMMON="--features $F --pack-tokens 1024 --loss-on all --eval-packs 8"

# 0. (measured, not used) gen-data on the same core budget: 48 prompts in 122 s, 3,511 new tokens
#    (29 tokens/s on one thread, batch 24) against ~310 tokens/s for `extract` on one thread (step 1's logs)
spechead gen-data --target demo --threads 1 --batch-size 24 --max-new-tokens 192 --max-prompt-tokens 384 \
  --out /tmp/gen/gen.jsonl --data $D/chat_sharegpt.jsonl.gz:600 $D/chat_alpacaeval.jsonl.gz:600 \
  $D/chat_arenahard.jsonl.gz:300 $D/chat_gpteacher.jsonl.gz:300 $D/math_gsm8k_train.jsonl.gz:600 \
  $D/mt_de_en.jsonl.gz:500 $D/summ_t0_news.jsonl.gz:400 $D/qa_nq_open.jsonl.gz:400 $D/qa_t0_context.jsonl.gz:400 \
  $D/code_instruct.jsonl.gz:300 $D/math_MATH.jsonl.gz:200 &
sleep 122; kill %1; wait || true

# 1. features: the same mix as stage 1 (same chunk order), two one-thread workers, stopped at the end of
#    the time slot; training uses every chunk present
for i in 0 1; do
  spechead extract --threads 1 --arch eagle3 --max-len 768 --chunk-tokens 16384 --features $F --shard $i/2 \
    --data $DATA > /tmp/run/extractC$i.log 2>&1 &
done
sleep 2040; kill %1 %2; wait || true   # 34 min: chunks 0-87, 1,463,216 tokens

# 2. EAGLE-2 (from stage 1's shipped drafter) and EAGLE-3 (3 unrolled steps, from stage 1's), in parallel
spechead train-drafter $COMMON --threads 1 --arch eagle2 --out /tmp/run/eagle2d --init /tmp/run/eagle2c \
  --max-steps 3600 --epochs 3 --lr 1e-3 --warmup 20 --ce-positions 128 --ce-weight 0.5 --noise 0.1 \
  --save-every 200 --eval-every 600 > /tmp/run/eagle2d.log 2>&1 &
spechead train-drafter $COMMON --threads 1 --arch eagle3 --out /tmp/run/eagle3d --init /tmp/run/eagle3b \
  --ttt-steps 3 --max-steps 1000 --epochs 1 --lr 1e-3 --warmup 20 --ce-positions 64 \
  --save-every 100 --eval-every 250 > /tmp/run/eagle3d.log 2>&1
wait

# 3. SlimSpec rank 72 post hoc on the frozen EAGLE-3 drafter (SVD init, distilled from its tied head),
#    alongside a second EAGLE-2 stretch; then VocabTrim lists from the EAGLE-2 drafter of step 2
spechead train-drafter $COMMON --threads 1 --arch eagle3 --out /tmp/run/eagle3-lowrank72d --init /tmp/run/eagle3d \
  --head lowrank:72 --lowrank-init svd --freeze-backbone --ttt-steps 2 --max-steps 700 --lr 2e-3 --warmup 10 \
  --ce-positions 256 --save-every 100 --eval-every 350 > /tmp/run/eagle3-lowrank72d.log 2>&1 &
spechead train-drafter $COMMON --threads 1 --arch eagle2 --out /tmp/run/eagle2e --init /tmp/run/eagle2d --seed 1 \
  --max-steps 800 --epochs 1 --lr 5e-4 --warmup 10 --ce-positions 128 --ce-weight 0.5 --noise 0.1 \
  --save-every 200 --eval-every 400 > /tmp/run/eagle2e.log 2>&1 &
spechead vocabtrim --target demo --drafter /tmp/run/eagle2d --threads 1 --sizes 8192,16384,32768 \
  --max-new-tokens 96 --out spechead/drafters/vocab/v49152 --prompts $D/chat_alpacaeval.jsonl.gz:20 \
  $D/chat_sharegpt.jsonl.gz:20 $D/mt_de_en.jsonl.gz:15 $D/summ_t0_news.jsonl.gz:15 $D/qa_nq_open.jsonl.gz:15 \
  $D/qa_t0_context.jsonl.gz:10 $D/math_gsm8k_train.jsonl.gz:15 $D/code_instruct.jsonl.gz:10
wait

# 4. ship
for p in eagle2:eagle2e eagle3:eagle3d eagle3-lowrank72:eagle3-lowrank72d; do
  cp /tmp/run/${p##*:}/{config.json,model.safetensors} spechead/drafters/${p%%:*}/
done
