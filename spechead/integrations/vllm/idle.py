"""No drafter pass in a decode step that drafts nothing.

vLLM's chain length by batch size (``num_speculative_tokens_per_batch_size``) can give K = 0 where a round stops
paying, but vLLM still runs the drafter over the step's tokens then, to keep the drafter's KV cache in step. On a
2-core CPU that pass costs about a tenth of a batch-8 step, while vLLM's n-gram proposer, which has no drafter, costs
nothing at K = 0 (``results/vllm/k0_overhead.py``). For spechead's drafters a decode step at K = 0 (every request one
token) skips the pass; steps with a prefill still run it, so every prompt reaches the drafter's cache. The price:
tokens decoded in a K = 0 stretch are missing from the drafter's cache when drafting resumes, so fewer drafts are
accepted after a busy stretch; outputs never change (verification decides them). ``SPECHEAD_VLLM_IDLE_PASS=1``
keeps vLLM's pass.
"""

from __future__ import annotations

import functools
import os

import torch

SKIPPED = [0]  # decode steps whose drafter pass was skipped in this process (the integration test reads it)


def skip_idle_passes() -> None:
    """Wrap vLLM's proposer once per process (called when a spechead drafter is built, so vLLM is fully loaded)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    if os.environ.get("SPECHEAD_VLLM_IDLE_PASS") == "1" or getattr(SpecDecodeBaseProposer.propose, "spechead", False):
        return
    propose = SpecDecodeBaseProposer.propose

    @functools.wraps(propose)
    def skipping(self, num_speculative_tokens, *args, **kwargs):
        meta = kwargs.get("common_attn_metadata")
        if num_speculative_tokens == 0 and meta is not None and meta.max_query_len == 1 and _ours(self):
            self.num_speculative_tokens, self._last_draft_probs = 0, None
            SKIPPED[0] += 1
            return torch.empty(meta.batch_size(), 0, dtype=torch.int64, device=kwargs["next_token_ids"].device)
        return propose(self, num_speculative_tokens, *args, **kwargs)

    skipping.spechead = True
    SpecDecodeBaseProposer.propose = skipping


def _ours(proposer) -> bool:
    """Whether the proposer drafts with a spechead drafter (looked up once)."""
    found = getattr(proposer, "_spechead_drafter", None)
    if found is None:
        from spechead.integrations.vllm.model import head_module

        found = proposer._spechead_drafter = head_module(proposer.model) is not None
    return found
