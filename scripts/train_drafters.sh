#!/usr/bin/env bash
# The demo drafters' CPU recipe: fine-tune SmolLM2-135M-Instruct's EAGLE-2, EAGLE-3 and rank-72 SlimSpec drafters on
# the target's own greedy replies, then measure them. One step per call; every step resumes where it stopped.
# Generated data and features stay outside the repository (W). docs/training.md explains the recipe and its figures.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash scripts/train_drafters.sh gen|extract|train|heldout|accept
       (from the repository root, with the venv active)

  gen      greedy replies of the fp32 target on spechead's batched decoder (32 in flight), to prompts of the
           benchmark's categories (none of its prompts) -> $W/greedy.jsonl; stopped after GEN_MIN minutes (18)
  extract  the target's EAGLE-3 features of those replies (the three fused layers and the final normed state,
           which the EAGLE-2 drafter reads too), two one-thread workers -> $W/feats
  train    the ARMS, one thread each, two at a time, from their INIT folders -> $W/NAME (a drafter folder),
           metrics and training log -> $R/NAME/
             e2    EAGLE-2, from INIT_E2 (spechead/drafters/eagle2)
             e3    EAGLE-3 with its head tied to the target's, from INIT_E3 (spechead/drafters/eagle3)
             lr72  the rank-72 SlimSpec drafter, backbone and low-rank head trained together against the
                   target's distribution, from INIT_LR72 (spechead/drafters/eagle3-lowrank72)
  heldout  the starting drafters' held-out top-1 per unrolled step on the packs the training runs report on
           -> $R/heldout_init_NAME.json (compare with $R/NAME/metrics.json)
  accept   tokens committed per round (chains of 3 and 5, the 2x4x8 tree, no lookup branch) on the benchmark's
           held-out prompts, greedy, one thread each, for DRAFTERS="NAME:FOLDER ..." (default: the three shipped
           drafters) -> $R/acceptance_NAME.json, then prints benchmarks/acceptance_table.py's tables

Environment (defaults in parentheses): W (/tmp/spechead-train), R ($W/results), D (../shared/data/train),
PROMPTS (a prompt file from scripts/training_prompts.py; default: a fixed mix of D's chat, code, math,
summarization, translation and QA files), SEED (27), GEN_MIN (18), ARMS (e2 e3 lr72), PACK (2048), CE (256),
LR (1e-4), WARMUP (50), TRAIN_MIN (45), STEPS (100000), DRAFTERS.
On 2 cores: gen 18 min, extract about 13 min for 350 k tokens, train TRAIN_MIN per pair of arms,
accept about 10 min per pair of drafters.
To ship a drafter, copy its config.json and model.safetensors over spechead/drafters/<name>/.
EOF
}

W=${W:-/tmp/spechead-train}; R=${R:-$W/results}; D=${D:-../shared/data/train}
INIT_E2=${INIT_E2:-spechead/drafters/eagle2}; INIT_E3=${INIT_E3:-spechead/drafters/eagle3}
INIT_LR72=${INIT_LR72:-spechead/drafters/eagle3-lowrank72}
ARMS=${ARMS:-e2 e3 lr72}

init_of() { case $1 in e2) echo $INIT_E2 ;; e3) echo $INIT_E3 ;; lr72) echo $INIT_LR72 ;; esac; }
arch_args() {  # the train-drafter arguments that make an arm
  case $1 in
  e2) echo "--arch eagle2" ;;
  e3) echo "--arch eagle3" ;;
  lr72) echo "--arch eagle3 --head lowrank:72 --lowrank-teacher target" ;;
  *) echo "unknown arm $1 (e2, e3, lr72)" >&2; return 2 ;;
  esac
}
two_at_a_time() { [ "$(jobs -r | wc -l)" -ge 2 ] && wait -n || true; }

gen() {
  local data=(${PROMPTS:-$D/chat_sharegpt.jsonl.gz:1500 $D/chat_alpacaeval.jsonl.gz:600 $D/chat_gpteacher.jsonl.gz:800
    $D/chat_arenahard.jsonl.gz:500 $D/code_instruct.jsonl.gz:800 $D/math_gsm8k_train.jsonl.gz:1000
    $D/math_MATH.jsonl.gz:500 $D/summ_t0_news.jsonl.gz:500 $D/summ_scitldr.jsonl.gz:300 $D/mt_de_en.jsonl.gz:1000
    $D/qa_nq_open.jsonl.gz:600 $D/qa_t0_context.jsonl.gz:600})
  timeout ${GEN_MIN:-18}m spechead gen-data --engine spechead --batch-size 32 --max-new-tokens 192 --threads 2 \
    --seed ${SEED:-27} --out $W/greedy.jsonl --data "${data[@]}" || true
  python scripts/whole_records.py $W/greedy.jsonl  # a generation stopped by the clock: whole records only
  cp $W/greedy.jsonl.manifest.json $R/gen_data_manifest.json
}

extract() {
  local i
  for i in 0 1; do
    spechead extract --threads 1 --arch eagle3 --max-len 768 --chunk-tokens 16384 --features $W/feats --shard $i/2 \
      --data $W/greedy.jsonl > $W/extract$i.log 2>&1 &
  done; wait
}

train() {
  # A gentle fine-tune: from drafters trained on a GPU with packs of 4,096 and 1,024 CE positions, a larger rate
  # (5e-4 to 7e-4) with 64 CE positions in packs of 1,024 lost held-out top-1 within 100 steps.
  local common="--features $W/feats --pack-tokens ${PACK:-2048} --loss-on all --eval-packs 8 --threads 1 --epochs 4
    --ce-positions ${CE:-256} --ce-weight 0.5 --noise 0.1 --save-every 50 --eval-every 50 --seed 12 --quiet
    --ttt-steps 3 --lr ${LR:-1e-4} --warmup ${WARMUP:-50} --max-minutes ${TRAIN_MIN:-45} --max-steps ${STEPS:-100000}"
  local arm
  for arm in $ARMS; do arch_args $arm > /dev/null || exit 2; done
  for arm in $ARMS; do
    spechead train-drafter $common $(arch_args $arm) --init $(init_of $arm) --out $W/$arm > $W/$arm.log 2>&1 &
    two_at_a_time
  done; wait
  for arm in $ARMS; do mkdir -p $R/$arm; cp $W/$arm/metrics.json $W/$arm/train_log.jsonl $R/$arm/; done
}

heldout() {
  local arm
  for arm in $ARMS; do
    python benchmarks/drafter_heldout.py --features $W/feats --drafter $(init_of $arm) --ttt-steps 3 \
      --pack-tokens ${PACK:-2048} > $R/heldout_init_$arm.json &
    two_at_a_time
  done; wait
}

accept() {
  local d files=()
  for d in ${DRAFTERS:-e2:$INIT_E2 e3:$INIT_E3 lr72:$INIT_LR72}; do
    SPECHEAD_TUNE=off spechead bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 \
      --threads 1 --no-guard --warmup 0 --methods ar,eagle@chain:3,eagle@chain:5,eagle@2x4x8 \
      --drafter ${d#*:} --json $R/acceptance_${d%%:*}.json > $W/bench_${d%%:*}.log 2>&1 &
    files+=($R/acceptance_${d%%:*}.json)
    two_at_a_time
  done; wait
  python benchmarks/acceptance_table.py "${files[@]}"
}

case "${1:-}" in
gen | extract | train | heldout | accept) mkdir -p $W $R; "$1" ;;
-h | --help) usage ;;
*) usage >&2; exit 2 ;;
esac
