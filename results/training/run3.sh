#!/usr/bin/env bash
# Stage 3 (fourth session, quiet 2-core CPU): the rest of the training mix's features, then one more
# EAGLE-2 stretch from stage 2's shipped drafter. Run from the repository root, venv active.
set -euo pipefail
source "$(dirname "$0")/data_mix.sh"  # D, DATA
F=/tmp/run/feats

# 1. features: chunks 88-129 (stage 2 stopped at 87), two one-thread workers; 0.70 M tokens
for i in 0 1; do
  spechead extract --threads 1 --arch eagle3 --max-len 768 --chunk-tokens 16384 --features $F --shard $i/2 \
    --data $DATA > /tmp/run/extractD$i.log 2>&1 &
done
wait

# 2. EAGLE-2 from stage 2's shipped drafter over all 130 chunks (2.16 M tokens), one thread
spechead train-drafter --features $F --pack-tokens 1024 --loss-on all --eval-packs 8 --threads 1 --arch eagle2 \
  --out /tmp/run/eagle2f --init /tmp/run/eagle2e --seed 2 --max-steps 4000 --epochs 3 --lr 5e-4 --warmup 10 \
  --ce-positions 128 --ce-weight 0.5 --noise 0.1 --save-every 200 --eval-every 1000 > /tmp/run/eagle2f.log 2>&1
