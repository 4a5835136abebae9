#!/usr/bin/env bash
# The exact commands that trained the committed demo drafters, in the order they ran (see
# docs/training.md for timings and metrics). Run from the repository root with the venv active.
# Features go to /tmp/run/feats (about 6 KB per token with the EAGLE-3 layer states).
set -euo pipefail
source "$(dirname "$0")/data_mix.sh"  # D, DATA
F=/tmp/run/feats
COMMON="--threads 2 --features $F --pack-tokens 1024 --loss-on all --save-every 10 --eval-packs 8"

extract() {  # two workers; stopped by hand at the end of a time slot (training uses the finished chunks)
  for i in 0 1; do
    spechead extract --threads "$1" --arch eagle3 --max-len 768 --chunk-tokens 16384 --features $F \
      --shard $i/2 --data $DATA > /tmp/run/extract$i.log 2>&1 &
  done
}

# 1. features, 34 min under load: chunks 0-6 (116,301 tokens)
extract 2; sleep 2040; kill %1 %2

# 2. EAGLE-2 stretch 1 and EAGLE-3 stretch 1 (2 unrolled steps), in parallel
spechead train-drafter $COMMON --arch eagle2 --out /tmp/run/eagle2 --epochs 3 --lr 1.5e-3 --warmup 10 \
  --ce-positions 96 --ce-weight 0.5 --noise 0.1 &
spechead train-drafter $COMMON --arch eagle3 --out /tmp/run/eagle3 --ttt-steps 2 --epochs 1 --lr 1.5e-3 \
  --warmup 10 --ce-positions 64
wait

# 3. EAGLE-3 stretch 2 (shipped as eagle3/)
spechead train-drafter $COMMON --arch eagle3 --out /tmp/run/eagle3b --init /tmp/run/eagle3 --ttt-steps 2 \
  --epochs 1 --seed 1 --lr 1e-3 --warmup 5 --ce-positions 64

# 4. SlimSpec rank 72, post hoc: SVD of the tied head, distilled from it on the frozen EAGLE-3 drafter;
#    30 steps, then resumed to 70 (shipped as eagle3-lowrank72/)
for n in 30 70; do
  spechead train-drafter $COMMON --arch eagle3 --out /tmp/run/eagle3-lowrank72 --init /tmp/run/eagle3b \
    --head lowrank:72 --lowrank-init svd --freeze-backbone --ttt-steps 2 --max-steps $n --lr 1e-3 --warmup 3 \
    --ce-positions 128
done

# 5. EAGLE-2 stretch 2 (same 7 chunks, 4 epochs)
spechead train-drafter $COMMON --arch eagle2 --out /tmp/run/eagle2b --init /tmp/run/eagle2 --seed 1 --epochs 4 \
  --lr 1e-3 --warmup 10 --ce-positions 96 --ce-weight 0.5 --noise 0.1 --save-every 20

# 6. more features (idle CPU, 7 min, one thread per worker): chunks 7-12, 216,336 tokens in all
extract 1; sleep 420; kill %1 %2

# 7. EAGLE-2 stretch 3 on the 13 chunks, 1 epoch (shipped as eagle2/)
spechead train-drafter $COMMON --arch eagle2 --out /tmp/run/eagle2c --init /tmp/run/eagle2b --seed 2 --epochs 1 \
  --lr 8e-4 --warmup 10 --ce-positions 96 --ce-weight 0.5 --noise 0.1 --save-every 20

# 8. ship (the OUT folders already hold the bf16 drafter) and evaluate
for p in eagle2:eagle2c eagle3:eagle3b eagle3-lowrank72:eagle3-lowrank72; do
  mkdir -p spechead/drafters/${p%%:*} && cp /tmp/run/${p##*:}/{config.json,model.safetensors} spechead/drafters/${p%%:*}/
done
python results/training/eval_drafters.py --limit 10 --max-new-tokens 128 --threads 2 \
  --drafters eagle2=spechead/drafters/eagle2 eagle2_stretch2=/tmp/run/eagle2b eagle3=spechead/drafters/eagle3 \
             lowrank72=spechead/drafters/eagle3-lowrank72 --out results/training/eval_specbench.json
