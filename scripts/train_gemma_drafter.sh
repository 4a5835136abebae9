#!/usr/bin/env bash
# Gemma 3 270M's shipped drafter (spechead/drafters/gemma3-270m), its fitted low-rank head and FR-Spec / VocabTrim
# lists, made with spechead's own pipeline on text the target generates, then the benchmark of every head on it
# (benchmarks/runs/gemma3-270m came from steps 7 and 10). Run from the repository root with the venv active
# (`pip install '.[gemma]'` brings the model); generated data and features stay outside the repository ($W), the
# benchmark's files go to $R. Each step resumes where it stopped. About 2.5 hours on 2 cores, most of it steps 1
# and 3 (docs/training.md, "Gemma 3 270M").
#   bash scripts/train_gemma_drafter.sh
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
D=${D:-../shared/data/train}; W=${W:-/tmp/gemma3-train}; OUT=spechead/drafters/gemma3-270m; R=${R:-$W/results}
mkdir -p $W $R
# 1. gen-data: the base model continues prompts of the benchmark's kinds (none of its prompts) in the completion
#    format, greedy, bf16 weights, batches of 64 sorted by prompt length, 128 new tokens; stopped at 40 min
timeout 2400 spechead gen-data --target gemma3-270m --dtype bfloat16 --batch-size 64 --max-new-tokens 128 --threads 2 \
  --seed 15 --out $W/greedy.jsonl \
  --data $D/chat_sharegpt.jsonl.gz:800 $D/chat_alpacaeval.jsonl.gz:400 $D/chat_gpteacher.jsonl.gz:800 \
  $D/chat_arenahard.jsonl.gz:300 $D/code_instruct.jsonl.gz:800 $D/math_gsm8k_train.jsonl.gz:600 $D/math_MATH.jsonl.gz:400 \
  $D/summ_t0_news.jsonl.gz:300 $D/summ_scitldr.jsonl.gz:200 $D/mt_de_en.jsonl.gz:600 $D/qa_nq_open.jsonl.gz:400 \
  $D/qa_t0_context.jsonl.gz:400 || true
# 2. features (final normed state) of the target in bf16 (3x faster here; stored in bf16 either way), two
#    one-thread workers, 768-token packs
for i in 0 1; do
  spechead extract --target gemma3-270m --threads 1 --arch eagle2 --max-len 768 --pack-tokens 768 --dtype bfloat16 \
    --chunk-tokens 32768 --features $W/feats --shard $i/2 --data $W/greedy.jsonl &
done; wait
# 3. EAGLE-2 from scratch: regression on the next feature + 262k-way soft CE on 64 sampled positions per pack
spechead train-drafter --target gemma3-270m --features $W/feats --arch eagle2 --out $W/eagle2 --threads 2 \
  --pack-tokens 1024 --loss-on all --lr 1e-3 --warmup 50 --max-steps ${STEPS:-2000} --epochs 4 \
  --ce-positions 64 --ce-weight 0.5 --noise 0.1 --eval-every 500 --eval-packs 8 --save-every 100 --seed 15
mkdir -p $OUT/eagle2 && cp $W/eagle2/config.json $W/eagle2/model.safetensors $OUT/eagle2/
# 4. its low-rank head, rank d/8 = 80, fitted to its own states (two 640 x 80 matrices stored)
spechead fit-lowrank --target gemma3-270m --drafter $OUT/eagle2 --features $W/feats --threads 2 | tee $R/fit_lowrank.json
# 5. FR-Spec lists from the target's own text and the training corpus (14.8M tokens; the generated text alone
#    uses under 16,384 distinct ids), VocabTrim lists from the drafter's proposals
spechead freq --tokenizer gemma3-270m --data $W/greedy.jsonl $D \
  --out spechead/drafters/vocab/v262144
spechead vocabtrim --target gemma3-270m --drafter $OUT/eagle2 --threads 2 --limit 96 --max-new-tokens 48 \
  --prompts $D/chat_sharegpt.jsonl.gz:48 $D/code_instruct.jsonl.gz:48 --out spechead/drafters/vocab/v262144
# 6. the shared tree: what `spechead tune` picks for NanoSpec on this drafter (then every method also on its own)
P=$(spechead tune --target gemma3-270m --drafter $OUT/eagle2 --head nanospec --threads 2 --quiet | tail -1 | sed 's/.*: //')
T=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['choice']['tree'])" "$P"); echo "shared tree $T"
# 7. the benchmark: every method on its tuned default (tree auto, per head) and on the shared tree,
#    the drafter alone (no lookup branch) beside them, raw speculation (no guard), per category, one run
M=hf,ar,eagle,fr,vocabtrim,nanospec,hybrid,lowrank
spechead bench --target gemma3-270m --drafter $OUT/eagle2 --suite spec-bench,humaneval:3 --limit 1 --limit-mt 1 \
  --max-new-tokens 96 --threads 2 --no-guard \
  --methods $M,eagle@$T,fr@$T,vocabtrim@$T,nanospec@$T,hybrid@$T,lowrank@$T,eagle@2x1x4,eagle@chain:3 \
  --json $R/bench.json --report $R/report --quiet
spechead bench-heads --shape gemma3-270m --batch 1,10 --dtype fp32 --threads 2 --json $R/heads_fp32.json
# 8. NanoSpec with and without its source from the target's top logits over the prompt (ctx_topk)
spechead bench --target gemma3-270m --drafter $OUT/eagle2 --suite spec-bench,humaneval:3 --limit 1 --limit-mt 1 \
  --max-new-tokens 96 --threads 2 --no-guard \
  --methods ar,eagle@$T,nanospec@$T,nanospec:ctx_topk=0@$T \
  --json $R/bench_ctx_topk.json --quiet
# 9. the drafter alone on larger trees (tau only: the full head's cost does not change it, FR-Spec's list covers it)
spechead bench --target gemma3-270m --drafter $OUT/eagle2 --suite spec-bench,humaneval:3 --limit 1 --limit-mt 1 \
  --max-new-tokens 96 --threads 2 --no-guard --methods fr@2x4x8,fr@4x4x16,eagle@10x6x60 --json $R/bench_trees.json --quiet
# 10. the tuned defaults as a user runs them: the guard on
spechead bench --target gemma3-270m --drafter $OUT/eagle2 --suite spec-bench,humaneval:3 --limit 1 --limit-mt 1 \
  --max-new-tokens 96 --threads 2 --methods ar,eagle,fr,vocabtrim,nanospec,hybrid,lowrank,eagle@$T \
  --json $R/bench_guard.json --quiet
