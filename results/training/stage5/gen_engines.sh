#!/usr/bin/env bash
# gen-data's two engines on the same 96 prompts (fourteenth session, AMD EPYC Zen 3, AVX2, 2 threads, idle):
# spechead 13,883 new tokens at 260.0 tok/s, transformers 13,883 at 140.4 tok/s, 96/96 records identical.
set -euo pipefail
D=../shared/data/train; W=${W:-/tmp/gen_engines}; mkdir -p $W
for e in spechead transformers; do
  spechead gen-data --engine $e --batch-size 32 --max-new-tokens 192 --threads 2 --seed 15 --out $W/$e.jsonl \
    --stop-after 96 --data $D/chat_sharegpt.jsonl.gz:300 $D/code_instruct.jsonl.gz:100 \
    $D/math_gsm8k_train.jsonl.gz:100 $D/qa_t0_context.jsonl.gz:100
  python -c "import json; m = json.load(open('$W/$e.jsonl.manifest.json')); print('$e', m['records'], m['new_tokens'], round(m['new_tokens'] / m['generate_s'], 1), 'tok/s')"
done
cmp $W/spechead.jsonl $W/transformers.jsonl && echo "records identical"
