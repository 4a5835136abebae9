#!/usr/bin/env bash
# batch1_ab.py on BASE (a worktree imported ahead of the editable install) and on the working tree, twice, interleaved.
# Usage: bash results/batch/s15/batch1_ab.sh [BASE] (default 302f517)
set -euo pipefail
BASE=${1:-302f517}; OLD=/tmp/spechead-$BASE; PY=$PWD/.venv/bin/python; HERE=$PWD/results/batch/s15
[ -d "$OLD" ] || git worktree add -q "$OLD" "$BASE"
# the old tree finds the data relative to itself: point it at this checkout's
export SPECHEAD_EVAL_DIR=${SPECHEAD_EVAL_DIR:-$("$PY" -c "from spechead.cli.bench import default_eval_dir; print(default_eval_dir())")}
for i in 1 2; do
  (cd "$OLD" && PYTHONPATH="$OLD" "$PY" "$HERE/batch1_ab.py" "$BASE") 2>&1 | tail -1
  "$PY" "$HERE/batch1_ab.py" "working tree" 2>&1 | tail -1
done
