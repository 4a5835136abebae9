"""The vLLM export format (``spechead export --format vllm``): a drafter and its head choice as a folder vLLM
loads. Importing this needs no vLLM.

The folder is an EAGLE-3 or EAGLE-1/2 checkpoint in the published layout (config.json + model.safetensors) that
vLLM's own loader reads, with two additions the spechead plugin (``spechead.integrations.vllm``) reads:
``architectures`` naming the plugin's drafter class (``VLLM_ARCH`` for EAGLE-3, which ends in ``Eagle3``;
``VLLM_ARCH_EAGLE`` for EAGLE-1/2, which starts with ``Eagle``: the names vLLM's EAGLE config keeps as they are)
and a ``spechead`` block naming the head. vLLM runs the first with ``"method": "eagle3"``, the second with
``"method": "eagle"`` (``VLLM_METHOD``). The head is resolved here, with spechead's own code, and written as plain
data, so vLLM needs nothing but the folder: a low-rank head's factors (the drafter's own, re-truncated, or the
SVD of its full head) go into the checkpoint as ``lm_head.down/up.weight`` with ``lm_head_rank``; a static subset
(``fr`` / ``vocabtrim``) is written as the token list its head drafts from; ``nanospec[...]`` needs only the
full head's rows, so its block carries the spec with its options. ``lookup_first`` adds ``"lookup_first": true``:
the plugin then takes a round's draft token from the request's context lookup where it matches (spechead's
``chain:1+lookup-first``; vLLM with one speculative token). Weights are written in float32, the
dtype the engines draft in (bf16 checkpoints widen exactly), so both engines read the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spechead.errors import SpecheadError

VLLM_ARCH = "SpecheadLlamaForCausalLMEagle3"
VLLM_ARCH_EAGLE = "EagleSpecheadLlamaForCausalLM"
VLLM_METHOD = {"eagle3": "eagle3", "eagle2": "eagle"}  # spechead drafter arch -> vLLM speculative method
CONFIG_KEY = "spechead"  # the config.json block the plugin reads: {"head": SPEC, ...}
FORMATS = ("vllm",)
HEADS = ("full", "lowrank", "fr", "vocabtrim", "nanospec")  # what the plugin's drafter class runs (see its docs)


def keeps_request_state(spec: str, lookup_first: bool = False) -> bool:
    """Whether the plugin keeps state per request for this head choice (a NanoSpec set, a context lookup): vLLM must
    then run with prefix caching off and an unpadded drafter batch (see the plugin)."""
    return lookup_first or spec.partition(":")[0] == "nanospec"


def export_vllm(drafter: Any, head: Any, spec: str, out: Path, source: str = "", lookup_first: bool = False) -> Path:
    """Write ``drafter`` (a spechead EAGLE-3 or EAGLE-2 drafter) with the built spechead ``head`` of spec ``spec``
    to ``out``; ``lookup_first``: draft from the context lookup where it matches (see the module docstring)."""
    from safetensors.torch import save_file

    from spechead.heads.full import FullHead
    from spechead.heads.lowrank import LowRankHead
    from spechead.heads.nanospec import NanoSpecHead
    from spechead.heads.subset import SubsetHead
    from spechead.heads.tokenmaps import save_token_map
    from spechead.model.drafter import Eagle2Drafter, Eagle3Drafter

    if not isinstance(drafter, Eagle3Drafter | Eagle2Drafter):
        raise SpecheadError("vLLM export takes an EAGLE-3 or EAGLE-2 drafter")
    eagle3 = isinstance(drafter, Eagle3Drafter)
    name = spec.partition(":")[0]
    if name not in HEADS:
        raise SpecheadError(f"head {name!r} cannot run inside vLLM's EAGLE path; exportable: {', '.join(HEADS)}")
    state = dict(drafter.checkpoint_state())
    cfg = drafter.draft_config()
    block: dict[str, Any] = {"head": name, "spec": spec, "source": source}
    if lookup_first:
        block["lookup_first"] = True
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(head, LowRankHead):
        up, down = head.scorer.factors
        for k in [k for k in state if k.startswith("lm_head.")]:
            del state[k]
        state["lm_head.up.weight"], state["lm_head.down.weight"] = up, down
        cfg["lm_head_rank"] = int(down.shape[0])
        if eagle3:
            cfg["tie_lm_head_to_target"] = False
        block["rank"] = int(down.shape[0])
    elif isinstance(head, SubsetHead):
        file = f"{name}_{head.size}.pt"
        save_token_map(head.ids.tolist(), out / file)
        block["head"], block["size"] = f"{name}:{file}", head.size
    elif isinstance(head, NanoSpecHead):  # the full head's rows, picked per request in vLLM: its options only
        block["head"] = spec
    elif not isinstance(head, FullHead):
        raise SpecheadError(f"head {spec!r} has no vLLM form")
    cfg["architectures"] = [VLLM_ARCH if eagle3 else VLLM_ARCH_EAGLE]
    cfg["torch_dtype"] = "float32"
    cfg[CONFIG_KEY] = block
    state = {k: (v.float() if v.is_floating_point() else v).detach().contiguous().cpu() for k, v in state.items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
