"""Experiment (not in the plugin): what batch 8 gains if vLLM skips the drafter's pass in a decode step at K = 0.

With a chain length by batch size that drafts nothing from batch 5 (``1-4:1,5-256:0``), vLLM still runs the
drafter over each step's tokens to keep its KV cache in step (2.2 ms of a 38-ms batch-8 step on CPU C,
``step_profile.py``). This runs a vLLM job (``run.py``'s arguments: job and result paths) with vLLM's proposer
wrapped to return no drafts without that pass in a decode step at K = 0 (every request one token; prefills still
run it). Outputs cannot change (verification decides them); drafts after a skipped stretch would see a drafter cache
with holes, which is why the plugin does not do this (docs/vllm.md). Used through ``paired.py --child``::

    .venv-vllm/bin/python results/vllm/paired.py --batches 8 --child results/vllm/k0_skip.py \\
        --out results/vllm/s28_paired_k0_skip.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SKIPPED = [0]


def skip_k0_decode_passes() -> None:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    propose = SpecDecodeBaseProposer.propose

    def skipping(self, num_speculative_tokens, *args, **kwargs):
        meta = kwargs.get("common_attn_metadata")
        if num_speculative_tokens == 0 and meta is not None and meta.max_query_len == 1:
            self.num_speculative_tokens, self._last_draft_probs = 0, None
            SKIPPED[0] += 1
            return torch.empty(meta.batch_size(), 0, dtype=torch.int64, device=kwargs["next_token_ids"].device)
        return propose(self, num_speculative_tokens, *args, **kwargs)

    SpecDecodeBaseProposer.propose = skipping


if __name__ == "__main__":
    from spechead.integrations.vllm.run import run_job

    skip_k0_decode_passes()
    res = run_job(json.loads(Path(sys.argv[1]).read_text()))
    res["passes_skipped"] = SKIPPED[0]
    Path(sys.argv[2]).write_text(json.dumps(res))
