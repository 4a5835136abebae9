#!/usr/bin/env bash
# The code-only branch a GPU device call runs from: a call carries the working tree, at most 64 MiB with what
# `carry` names, and the repository with its drafters' weights is larger. The branch holds spechead without its
# weights, the GPU check and the tests it runs, the GPU study (benchmarks/gpu.py and the two kept runs its speedup
# model reads) and the training scripts, as committed at HEAD. Built through a temporary index, so the working tree
# and the real index are untouched.
#   bash scripts/train_gpu/code_branch.sh [BRANCH]      (default gpu-train)
# Then `git checkout BRANCH` before the device calls (.gpu/ is ignored), and back to your branch and
# `git branch -D BRANCH` after.
set -euo pipefail
case "${1:-}" in -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
BRANCH=${1:-gpu-train}
PATHS=(spechead tests/conftest.py tests/test_data.py tests/test_train.py benchmarks/gpu_check.py scripts
  benchmarks/gpu.py benchmarks/runs/headline-zen4/bench_avx512.json benchmarks/runs/gemma3-270m/bench.json
  pyproject.toml .gitignore)
export GIT_INDEX_FILE=$(mktemp -u)
trap 'rm -f "$GIT_INDEX_FILE"' EXIT
git ls-tree -r HEAD -- "${PATHS[@]}" | grep -v $'\tspechead/drafters/' | git update-index --add --index-info
commit=$(git commit-tree "$(git write-tree)" -m "code only, for a GPU device call (from $(git rev-parse --short HEAD))")
git branch -f "$BRANCH" "$commit"
echo "$BRANCH: $(git ls-tree -r "$BRANCH" | wc -l) files, $(git ls-tree -r -l "$BRANCH" | awk '{s += $4} END {print s}') bytes"
