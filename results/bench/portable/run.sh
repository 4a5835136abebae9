#!/usr/bin/env bash
# Issue 12's measurements, in one quiet run on 2 threads: per kernel build (the CPU's best, then AVX2 forced),
# the tuner's choice, the benchmark with the tuned (auto) trees, the head bench at Llama-3.1-8B shapes, the step
# costs; then the always-wrong drafter under the guard. Usage: bash results/bench/portable/run.sh OUT_DIR ISA...
set -euo pipefail
OUT=${1:?out dir}; shift
source results/bench/tune_bench.sh  # SH, tune_and_bench
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
for ISA in "$@"; do
  export SPECHEAD_ISA=$ISA
  tune_and_bench "$OUT" "$ISA"
  $PY results/bench/step-cost/measure.py --threads 2 --out "$OUT/step_$ISA.json" > /dev/null
  $SH bench-heads --shape llama3.1-8b --batch 1,10 --dtype bf16 --repeats 7 --threads 2 --json "$OUT/heads_llama3.1-8b_bf16_$ISA.json" > "$OUT/heads_$ISA.txt"
done
unset SPECHEAD_ISA
# the always-wrong drafter on EAGLE-2's deep tree: with the guard (default) and without
$SH bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 --threads 2 --drafter random \
  --tree 2x4x8 --methods ar,eagle,nanospec --json "$OUT/random_guard.json" --quiet
$SH bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 --threads 2 --drafter random \
  --tree 2x4x8 --methods ar,eagle,nanospec --no-guard --json "$OUT/random_noguard.json" --quiet
