# Issue 12's headline, shared by results/bench/portable/run.sh (per kernel build) and results/bench/zen3/run.sh:
# the tuner's choice per head, then the README's benchmark with the default (auto) trees plus the full head on
# NanoSpec's tuned tree. Source it, then: tune_and_bench OUT_DIR TAG (files OUT_DIR/tune_TAGhead.txt,
# OUT_DIR/bench_TAG.json or bench.json with an empty TAG). SH may name another spechead (a dry run: SH=echo).
SH=${SH:-.venv/bin/spechead}
tune_and_bench() {
  local out=$1 tag=$2 head tree
  # the bench's `lowrank` decodes the shipped rank-72 SlimSpec drafter (EAGLE-3), the others the EAGLE-2 drafter
  for head in full nanospec lowrank; do
    local d=(); [ $head = lowrank ] && d=(--drafter spechead/drafters/eagle3-lowrank72 --arch eagle3)
    $SH tune --threads 2 --head $head "${d[@]}" --quiet > /dev/null
    $SH tune --threads 2 --head $head "${d[@]}" --show > "$out/tune_${tag:+${tag}_}$head.txt"
  done
  tree=$(grep '^chosen: tree' "$out/tune_${tag:+${tag}_}nanospec.txt" | sed 's/^chosen: tree \([^ ,:]*\(:[0-9][0-9]*\)\?\).*/\1/')
  echo "${tag:-this CPU}: nanospec's tuned tree $tree"
  $SH bench --suite spec-bench,humaneval --limit 1 --limit-mt 1 --max-new-tokens 96 --threads 2 \
    --methods "hf,ar,eagle,nanospec,lowrank,eagle@$tree" --json "$out/bench${tag:+_$tag}.json" \
    --report "$out/report${tag:+_$tag}" --quiet
}
