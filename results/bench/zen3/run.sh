#!/usr/bin/env bash
# Issue 12's headline on this CPU (AMD EPYC Zen 3, AVX2 only, 2 cores): the tuner's choice per head, the README's
# benchmark with the default (auto) trees plus the full head on NanoSpec's tree, then the step costs.
# Usage: bash results/bench/zen3/run.sh
set -euo pipefail
OUT=results/bench/zen3
source results/bench/tune_bench.sh  # SH, tune_and_bench
PY=${PY:-.venv/bin/python}
tune_and_bench "$OUT" ""
$PY results/bench/step-cost/measure.py --threads 2 --out "$OUT/step.json" > /dev/null
