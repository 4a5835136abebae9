"""The same drafter and head in vLLM and in spechead's own engine, on the same token-id prompts.

Used by the integration test (tests/test_vllm_plugin.py) and the vLLM benchmark scripts. A method
is a shipped EAGLE-3 or EAGLE-2 drafter plus a spechead head spec; ``vllm_config`` turns it into vLLM's
``speculative_config`` (the plugin's folder, written by ``spechead export --format vllm`` and cached), and
``spechead_run`` decodes it with spechead's ``Decoder`` in a chain of the same length, without the never-slower
guard, so both engines draft the same tokens per round and their acceptance lengths can be compared.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from spechead.cache import cache_dir
from spechead.decoding.session import DEMO_DRAFTERS, Session
from spechead.decoding.tree import TreeConfig
from spechead.integrations.vllm.export import keeps_request_state


@dataclass(frozen=True)
class Method:
    """A drafter (a shipped folder's name under spechead/drafters) with a head spec; ``native``: vLLM's own
    EAGLE class on the published folder, unchanged (the full-head baseline vLLM users have today)."""

    name: str
    drafter: str
    head: str = "full"
    native: bool = False
    # the head spechead's engine runs for the comparison, when vLLM can feed the head only part of what spechead's
    # engine does (NanoSpec: no target logits, so no top-k sources); "": ``head``
    engine_head: str = ""
    # the round's draft token from the request's context lookup where it matches (one speculative token; spechead's
    # engine: chain:1+lookup-first)
    lookup_first: bool = False

    @property
    def per_request(self) -> bool:
        """State kept per request (a NanoSpec head, a context lookup), which needs vLLM set up for it (the plugin)."""
        return keeps_request_state(self.head, self.lookup_first)

    @property
    def drafter_path(self) -> Path:
        return DEMO_DRAFTERS / self.drafter

    @property
    def vllm_method(self) -> str:
        """vLLM's speculative method for the drafter's architecture (``eagle3``, or ``eagle`` for EAGLE-1/2), read
        from its checkpoint's tensor names."""
        from safetensors import safe_open

        from spechead.integrations.vllm.export import VLLM_METHOD
        from spechead.model.drafter import detect_arch

        with safe_open(self.drafter_path / "model.safetensors", "pt") as f:
            return VLLM_METHOD[detect_arch(dict.fromkeys(f.keys()))]


# NanoSpec fed only what a vLLM proposer sees (no target logits): the head spechead's engine runs to compare with it
VLLM_NANOSPEC = "nanospec:ctx_topk=0:ext_from=tokens:policy=lru"
METHODS = {
    m.name: m
    for m in [
        Method("eagle3-full (vLLM native)", "eagle3", native=True),
        Method("eagle3-full (plugin)", "eagle3", "full"),
        Method("eagle3 + lowrank:72 (SVD)", "eagle3", "lowrank:72"),
        Method("eagle3-lowrank72 (trained)", "eagle3-lowrank72", "lowrank"),
        Method("eagle3 + fr:8192", "eagle3", "fr:8192"),
        Method("eagle3 + vocabtrim:8192", "eagle3", "vocabtrim:8192"),
        Method("eagle3 + nanospec", "eagle3", "nanospec", engine_head=VLLM_NANOSPEC),
        Method("eagle2-full (vLLM native)", "eagle2", native=True),
        Method("eagle2-full (plugin)", "eagle2", "full"),
        Method("eagle2 + lowrank:72 (SVD)", "eagle2", "lowrank:72"),
        Method("eagle2 + fr:8192", "eagle2", "fr:8192"),
        Method("eagle2 + vocabtrim:8192", "eagle2", "vocabtrim:8192"),
        Method("eagle2 + nanospec", "eagle2", "nanospec", engine_head=VLLM_NANOSPEC),
        Method("eagle2 + fr:8192 + lookup", "eagle2", "fr:8192", lookup_first=True),
        Method("eagle3 + fr:8192 + lookup", "eagle3", "fr:8192", lookup_first=True),
    ]
}


def export_dir(method: Method, session: Session, root: Path | None = None) -> Path:
    """The method's vLLM folder, exported once (spechead's own export) and kept under the cache, keyed by the
    drafter's files: new weights in the same folder get a new export, never a stale one."""
    from spechead.decoding.session import resolve_drafter
    from spechead.integrations.vllm.export import export_vllm

    if method.native:
        return method.drafter_path
    digest = hashlib.sha256()
    for f in sorted(method.drafter_path.iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    lookup = "-lookup" if method.lookup_first else ""
    name = f"{method.drafter_path.name}-{method.head.replace(':', '-')}{lookup}-{digest.hexdigest()[:12]}"
    out = (root or cache_dir() / "vllm-export") / name
    if not (out / "config.json").is_file():
        drafter = resolve_drafter(str(method.drafter_path), session.target)
        head = session.draft_head(drafter, method.head)
        export_vllm(drafter, head, method.head, out, str(method.drafter_path), method.lookup_first)
    return out


def parse_schedule(spec: str) -> list[tuple[int, int, int]]:
    """``"1-4:1,5-256:0"`` -> vLLM's ``num_speculative_tokens_per_batch_size`` (inclusive batch-size ranges, the
    chain length in each; 0 drafts nothing: vLLM then decodes those batches autoregressively)."""
    out = []
    try:
        for part in spec.split(","):
            sizes, _, k = part.partition(":")
            lo, _, hi = sizes.partition("-")
            out.append((int(lo), int(hi or lo), int(k)))
    except ValueError:
        raise ValueError(f"a schedule is START-END:K[,START-END:K...], e.g. 1-4:1,5-256:0; got {spec!r}") from None
    if out[0][0] != 1 or any(k < 0 or lo > hi for lo, hi, k in out):
        raise ValueError(f"a schedule starts at batch size 1, with START <= END and K >= 0; got {spec!r}")
    return out


def vllm_config(
    method: Method, folder: Path, k: int = 3, schedule: list[tuple[int, int, int]] | None = None
) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a method: its EAGLE method, a chain of k, greedy drafts through the
    head's ``get_top_tokens`` (no full-vocabulary logits); ``schedule``: the chain length by batch size (vLLM's
    dynamic speculative decoding), e.g. none from the batch size where a round stops paying."""
    if method.lookup_first and (k != 1 or any(n > 1 for _, _, n in schedule or [])):
        raise ValueError(f"{method.name}: lookup first drafts one token a round (k 1), got k {k}, schedule {schedule}")
    spec = {
        "method": method.vllm_method,
        "model": str(folder),
        "num_speculative_tokens": k,
        "use_local_argmax_reduction": True,
    }
    if schedule:
        spec["num_speculative_tokens_per_batch_size"] = [list(s) for s in schedule]
    if method.per_request:  # a request's drafter rows: its accepted tokens only (see the plugin)
        spec["disable_padded_drafter_batch"] = True
    return spec


def engine_args(method: Method | None) -> dict[str, Any]:
    """vLLM engine arguments a method needs: NanoSpec's per-request sets need prefix caching off (see the plugin)."""
    return {"enable_prefix_caching": False} if method is not None and method.per_request else {}


def vllm_job(
    session: Session,
    prompts: list[list[int]],
    max_tokens: int,
    speculative_config: dict[str, Any] | None = None,
    method: Method | None = None,
    batches: tuple[int, ...] = (1,),
    repeats: int = 1,
    compiled: bool = False,
) -> dict[str, Any]:
    """One job for ``run.spawn`` on the session's target folder (greedy, token-id prompts): AR for
    ``speculative_config=None``; ``method`` adds the engine arguments its head needs."""
    return {
        "target": str(session.float_folder),
        "hf_overrides": {"architectures": ["LlamaForCausalLM"]},  # the demo folder's config names none
        "prompts": prompts,
        "batches": list(batches),
        "max_tokens": max_tokens,
        "repeats": repeats,
        "enforce_eager": not compiled,
        "speculative_config": speculative_config,
        "engine_args": engine_args(method),
    }


def spechead_run(
    session: Session, method: Method | None, prompts: list[list[int]], max_new_tokens: int, k: int = 3
) -> dict[str, Any]:
    """spechead's engine, one request at a time: AR for ``method=None``, else a chain of k with the method's
    drafter and head (guard off). Returns outputs, tok/s over the timed runs and the mean acceptance length."""
    from spechead.decoding.session import resolve_drafter

    if method is None:
        dec = session.decoder()
    else:
        drafter = resolve_drafter(str(method.drafter_path), session.target)
        tree = replace(TreeConfig.chain(k), lookup_first=method.lookup_first)
        dec = session.decoder(drafter, method.engine_head or method.head, tree, guard=None)
    spec = method is not None
    dec.generate(prompts[0], 8, speculative=spec)  # warm-up
    outputs, rounds, committed, wall = [], 0, 0, 0.0
    for p in prompts:
        t = time.perf_counter()
        res = dec.generate(p, max_new_tokens, speculative=spec)
        wall += time.perf_counter() - t
        outputs.append(res.tokens)
        rounds += len(res.accept_lengths)
        committed += sum(res.accept_lengths)
    new = sum(len(o) for o in outputs)
    return {
        "outputs": outputs,
        "new_tokens": new,
        "wall_s": wall,
        "tok_s": new / wall,
        "acceptance_length": committed / rounds if rounds else None,
    }
