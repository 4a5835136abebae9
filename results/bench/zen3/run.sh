#!/usr/bin/env bash
# Issue 12's headline on this CPU (AMD EPYC Zen 3, AVX2 only, 2 cores): the tuner's choice per head, the README's
# benchmark with the default (auto) trees plus the full head on NanoSpec's tree, the step costs and the kernel
# comparison against the source before the chunk change. Usage: bash results/bench/zen3/run.sh
set -euo pipefail
OUT=results/bench/zen3
SH=".venv/bin/spechead"; PY=".venv/bin/python"
# the bench's `lowrank` decodes the shipped rank-72 SlimSpec drafter (EAGLE-3), the others the EAGLE-2 drafter
for head in full nanospec lowrank; do
  D=(); [ $head = lowrank ] && D=(--drafter spechead/drafters/eagle3-lowrank72 --arch eagle3)
  $SH tune --threads 2 --head $head "${D[@]}" --quiet > /dev/null
  $SH tune --threads 2 --head $head "${D[@]}" --show > "$OUT/tune_$head.txt"
done
TREE=$(grep '^chosen: tree' "$OUT/tune_nanospec.txt" | sed 's/^chosen: tree \([^ ,:]*\(:[0-9][0-9]*\)\?\).*/\1/')
echo "nanospec's tuned tree: $TREE"
$SH bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 --threads 2 \
  --methods "hf,ar,eagle,nanospec,lowrank,eagle@$TREE" --json "$OUT/bench.json" --report "$OUT/report" --quiet
$PY results/bench/step-cost/measure.py --threads 2 --out "$OUT/step.json" > /dev/null
