#!/usr/bin/env bash
# The code-only branch a device call runs from (a call carries the working tree, at most 64 MiB with what `carry`
# names; the repository with its drafters' weights is larger): spechead without its weights, the GPU check and the
# tests it runs, this stage's scripts, as committed at HEAD. Built through a temporary index, so the working tree
# and the real index are untouched; `git checkout gpu11` before the device calls (.gpu/ is in .git/info/exclude),
# `git checkout main && git branch -D gpu11` after.
#   bash results/training/stage11/code_branch.sh [BRANCH]
set -euo pipefail
BRANCH=${1:-gpu11}
PATHS=(spechead tests/conftest.py tests/test_data.py tests/test_train.py results/gpu results/training/stage11
  results/training/whole_records.py results/training/gpu_lib.sh pyproject.toml .gitignore)
export GIT_INDEX_FILE=$(mktemp -u)
trap 'rm -f "$GIT_INDEX_FILE"' EXIT
git ls-tree -r HEAD -- "${PATHS[@]}" | grep -v $'\tspechead/drafters/' | git update-index --add --index-info
commit=$(git commit-tree "$(git write-tree)" -m "code only, for a device call (from $(git rev-parse --short HEAD))")
git branch -f "$BRANCH" "$commit"
echo "$BRANCH: $(git ls-tree -r "$BRANCH" | wc -l) files, $(git ls-tree -r -l "$BRANCH" | awk '{s += $4} END {print s}') bytes"
