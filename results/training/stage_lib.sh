# Steps shared by the stages that train on the target's own replies (6, 7, 8); each stage's run.sh sets W (work
# folder, outside the repository) and R (its results folder), then sources this file.
D=../shared/data/train

# A drafter folder as committed at a revision (every file git holds for it), into DEST: the baseline a stage
# measures against after it has replaced the shipped weights.  drafter_at REV NAME DEST
drafter_at() {
  local f
  mkdir -p $3
  for f in $(git ls-tree --name-only $1 spechead/drafters/$2/); do git show $1:$f > $3/$(basename $f); done
}

# Greedy replies of the fp32 target (32 in flight) to prompts of the benchmark's categories (none of its prompts),
# into $W/greedy.jsonl, stopped after GEN_MIN minutes or PROMPTS prompts; the manifest goes to $R.
#   gen_replies SEED DEFAULT_MINUTES
gen_replies() {
  timeout ${GEN_MIN:-$2}m spechead gen-data --engine spechead --batch-size 32 --max-new-tokens 192 --threads 2 \
    --seed $1 --out $W/greedy.jsonl --stop-after ${PROMPTS:-2400} \
    --data $D/chat_sharegpt.jsonl.gz:1500 $D/chat_alpacaeval.jsonl.gz:600 $D/chat_gpteacher.jsonl.gz:800 \
    $D/chat_arenahard.jsonl.gz:500 $D/code_instruct.jsonl.gz:800 $D/math_gsm8k_train.jsonl.gz:1000 \
    $D/math_MATH.jsonl.gz:500 $D/summ_t0_news.jsonl.gz:500 $D/summ_scitldr.jsonl.gz:300 $D/mt_de_en.jsonl.gz:1000 \
    $D/qa_nq_open.jsonl.gz:600 $D/qa_t0_context.jsonl.gz:600 || true
  cp $W/greedy.jsonl.manifest.json $R/gen_data_manifest.json
}

# The fp32 target's features of those replies (eagle2: the final normed state; eagle3: also the three fused layers),
# two one-thread workers.  extract_features ARCH
extract_features() {
  for i in 0 1; do
    spechead extract --threads 1 --arch $1 --max-len 768 --chunk-tokens 16384 --features $W/feats --shard $i/2 \
      --data $W/greedy.jsonl > $W/extract$i.log 2>&1 &
  done; wait
}

# Tokens committed per round (chains of 3 and 5, the 2x4x8 tree, no lookup branch) on the benchmark's held-out
# prompts, greedy, one thread each, two drafters at a time, into $R/acceptance_NAME.json.
#   acceptance NAME:FOLDER...
acceptance() {
  local d
  for d in "$@"; do
    SPECHEAD_TUNE=off spechead bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 \
      --threads 1 --no-guard --warmup 0 --methods ar,eagle@chain:3,eagle@chain:5,eagle@2x4x8 \
      --drafter ${d#*:} --json $R/acceptance_${d%%:*}.json > $W/bench_${d%%:*}.log 2>&1 &
    [ "$(jobs -r | wc -l)" -ge 2 ] && wait -n
  done; wait
}

# Held-out top-1 per unrolled step of the drafters a stage started from ($W/shipped_NAME), on the packs its training
# runs report on (packs of PACK tokens), into $R/heldout_shipped_NAME.json.  heldout_shipped PACK NAME...
heldout_shipped() {
  local pack=$1 d; shift
  for d in "$@"; do
    python results/training/stage6/heldout.py --features $W/feats --drafter $W/shipped_$d --ttt-steps 3 \
      --pack-tokens $pack > $R/heldout_shipped_$d.json &
  done; wait
}
