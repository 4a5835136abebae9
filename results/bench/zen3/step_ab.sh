#!/usr/bin/env bash
# The demo target's decode step (and 8 / 16-row verifications) before and after the attention / fused-layer ops,
# interleaved in the same minutes: a worktree of the revision before them imported ahead of the editable install.
# Usage: bash results/bench/zen3/step_ab.sh [BASE] (default 4f3e483)
set -euo pipefail
BASE=${1:-4f3e483}; OLD=/tmp/spechead-$BASE; PY=$PWD/.venv/bin/python
[ -d "$OLD" ] || git worktree add -q "$OLD" "$BASE"
for i in 1 2; do
  for tree in "$OLD" "$PWD"; do
    (cd "$tree" && PYTHONPATH="$tree" "$PY" results/bench/step-cost/measure.py --threads 2 --rows 1,8,16 --out /tmp/step_ab.json > /dev/null)
    "$PY" -c "import json; d = json.load(open('/tmp/step_ab.json')); print('$tree', d['read_GBps'], 'GB/s, floor', d['floor_ms'], 'ms, step/verify ms', d['ms'], 'x floor', d['step_x_floor'])"
  done
done
