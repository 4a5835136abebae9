#!/usr/bin/env bash
# The headline benchmark: for each kernel build, `spechead tune` picks a tree per head (full, nanospec and the
# rank-72 `lowrank` drafter), then `spechead bench` runs 14 prompts x 96 new tokens (one Spec-Bench prompt per
# category with the MT-bench second turn, plus HumanEval) with hf, ar, eagle, nanospec, lowrank on their tuned
# (auto) trees, and the full head once more on NanoSpec's tree so the two heads compare on the same tree.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bash benchmarks/tune_and_bench.sh OUT_DIR [ISA ...]

  OUT_DIR  folder for the results (created)
  ISA      kernel builds to measure, e.g. avx512 avx2 generic (each run with SPECHEAD_ISA=ISA);
           none: the widest build this CPU runs

Writes, per build (the _ISA part is left out when no ISA is given):
  OUT_DIR/tune_ISA_HEAD.txt   `spechead tune --show` for HEAD in full, nanospec, lowrank
  OUT_DIR/bench_ISA.json      the benchmark (every method, per category, mismatches against AR)
  OUT_DIR/report_ISA/         its report.md and plots

Environment: SH (the spechead command, default .venv/bin/spechead; SH=echo prints the commands).
Takes about 10 minutes per build on 2 cores (three tunings of under a minute each, then the benchmark).
EOF
}

case "${1:-}" in -h | --help | "") usage; [ -n "${1:-}" ] && exit 0 || exit 2 ;; esac
OUT=$1; shift
SH=${SH:-.venv/bin/spechead}
mkdir -p "$OUT"

tune_and_bench() {  # tune_and_bench TAG (empty: no tag)
  local tag=$1 head tree
  for head in full nanospec lowrank; do
    # the bench's `lowrank` decodes the shipped rank-72 SlimSpec drafter (EAGLE-3), the others the EAGLE-2 drafter
    local d=(); [ $head = lowrank ] && d=(--drafter spechead/drafters/eagle3-lowrank72 --arch eagle3)
    $SH tune --threads 2 --head $head "${d[@]}" --quiet > /dev/null
    $SH tune --threads 2 --head $head "${d[@]}" --show > "$OUT/tune_${tag:+${tag}_}$head.txt"
  done
  tree=$(grep '^chosen: tree' "$OUT/tune_${tag:+${tag}_}nanospec.txt" \
    | sed 's/^chosen: tree \([^ ,:]*\(:[0-9][0-9]*\)\?\).*/\1/' || true)
  echo "${tag:-this CPU}: nanospec's tuned tree ${tree:-unknown}"
  $SH bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 --threads 2 \
    --methods "hf,ar,eagle,nanospec,lowrank${tree:+,eagle@$tree}" --json "$OUT/bench${tag:+_$tag}.json" \
    --report "$OUT/report${tag:+_$tag}" --quiet
}

if [ $# -eq 0 ]; then
  tune_and_bench ""
else
  for ISA in "$@"; do export SPECHEAD_ISA=$ISA; tune_and_bench "$ISA"; done
  unset SPECHEAD_ISA
fi
