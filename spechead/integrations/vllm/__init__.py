"""spechead's draft heads inside vLLM (``pip install 'spechead[vllm]'``).

vLLM calls ``register`` at start-up in every process (entry point ``vllm.general_plugins``). It adds two
drafter architectures, ``SpecheadLlamaForCausalLMEagle3`` (``model.SpecheadEagle3ForCausalLM``, an EAGLE-3
drafter) and ``EagleSpecheadLlamaForCausalLM`` (``model.SpecheadEagleForCausalLM``, an EAGLE-1/2 drafter), whose
draft head is a spechead head chosen by the ``spechead`` block of the drafter's config.json, which ``spechead
export --format vllm`` writes. The names end in ``Eagle3`` / start with ``Eagle`` so vLLM's EAGLE config keeps
them::

    LLM(target, speculative_config={"method": "eagle3", "model": FOLDER, "num_speculative_tokens": 3,
                                    "use_local_argmax_reduction": True})  # "method": "eagle" for EAGLE-2

``use_local_argmax_reduction`` makes vLLM ask the head for its top token (``get_top_tokens``) instead of
full-vocabulary logits, so a subset head never builds a [B, V] row. NanoSpec keeps one set per request, built from the
token ids the drafter's forward sees (``model``: a request is told apart by its first KV-cache block, since vLLM's
hooks carry no request identity; the target's top-k sources are not reachable).
"""

from __future__ import annotations

from spechead.integrations.vllm.export import VLLM_ARCH, VLLM_ARCH_EAGLE

CLASSES = {VLLM_ARCH: "SpecheadEagle3ForCausalLM", VLLM_ARCH_EAGLE: "SpecheadEagleForCausalLM"}


def register() -> None:
    """vLLM plugin hook: register the drafter classes by their import paths (vLLM imports them lazily)."""
    from vllm import ModelRegistry

    for arch, cls in CLASSES.items():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"spechead.integrations.vllm.model:{cls}")
