"""Runners: one callable per method that decodes a prompt and returns its :class:`Run` (transformers'
``generate``, llama.cpp (:mod:`spechead.bench.llamacpp`), the engine's AR or speculative decoder), built once per
method with the drafter each needs."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spechead.bench import llamacpp
from spechead.bench.methods import MethodSpec
from spechead.bench.runs import Run
from spechead.decoding.guard import GuardConfig
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.session import AUTO_TREE, Session, resolve_drafter, shipped_drafter_path
from spechead.errors import SpecheadError
from spechead.tuning.tune import resolve, with_tuner

LOWRANK_DEMO = "eagle3-lowrank72"  # the demo drafter trained with a rank-72 SlimSpec head

Runner = Callable[[list[int], int, SamplingConfig], Run]


class HFRunner:
    """transformers' own generate on the same checkpoint (the reference every user knows); with
    ``pld`` > 0, its prompt-lookup decoding (n-gram drafts copied from the context)."""

    def __init__(self, session: Session, pld: int = 0, model=None) -> None:
        if model is None:
            from transformers import AutoModelForCausalLM

            dtype = session.target.model.norm.weight.dtype
            model = AutoModelForCausalLM.from_pretrained(session.float_folder, dtype=dtype)
            model.eval()
        self.model, self.pld = model, pld
        self.stop_ids = session.stop_ids

    @torch.inference_mode()
    def __call__(self, ids: list[int], max_new: int, sampling: SamplingConfig) -> Run:
        x = torch.tensor([ids])
        kw: dict[str, Any] = {"do_sample": False}
        if not sampling.greedy:
            kw = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
            }
            torch.manual_seed(sampling.seed or 0)
        if self.pld:
            kw["prompt_lookup_num_tokens"] = self.pld
        t0 = time.perf_counter()
        out = self.model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            eos_token_id=self.stop_ids,
            pad_token_id=self.stop_ids[0],
            **kw,
        )
        wall = time.perf_counter() - t0
        toks = out[0, len(ids) :].tolist()
        return Run(toks, wall, [1] * max(len(toks) - 1, 0))


def engine_runner(dec, speculative: bool) -> Runner:
    def run(ids: list[int], max_new: int, sampling: SamplingConfig) -> Run:
        t0 = time.perf_counter()
        res = dec.generate(ids, max_new, sampling, speculative=speculative)
        wall = time.perf_counter() - t0
        trace = list(getattr(dec.head, "trace", None) or []) if speculative else []
        return Run(
            res.tokens, wall, res.accept_lengths, res.timers_ms, res.head_stats, res.prefill_s, trace,
            mode_rounds=res.mode_rounds,
        )  # fmt: skip

    return run


def run_prompt(runner: Runner, prompt: dict[str, Any], encode, decode, max_new: int, sampling: SamplingConfig) -> Run:
    """Every turn of a prompt; the method's own earlier answers go back into the conversation."""
    messages: list[dict[str, str]] = []
    total: Run | None = None
    for turn in prompt["turns"]:
        messages.append({"role": "user", "content": turn})
        run = runner(encode(messages), max_new, sampling)
        messages.append({"role": "assistant", "content": decode(run.tokens)})
        total = run if total is None else total + run
    assert total is not None
    return total


def rss_mb() -> float:
    """Current resident memory (Linux /proc; NaN elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return float("nan")
    return pages * resource.getpagesize() / 2**20


def build_runners(
    session: Session,
    specs: list[MethodSpec],
    drafters: dict[str, str],
    log: Callable[[str], None] = print,
    guard: bool = True,
) -> tuple[dict[str, Runner], dict[str, dict[str, Any]], dict[str, str]]:
    """One runner per method; methods that cannot be built here (a missing token list...) are skipped
    with their reason rather than failing the whole run."""
    session = with_tuner(session)  # `auto` trees resolve to this machine's tuning whoever opened the session
    runners: dict[str, Runner] = {}
    info: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    loaded: dict[str, Any] = {}
    hf_model = None
    for s in specs:
        before = rss_mb()
        try:
            if s.kind in ("hf", "pld"):
                runner = HFRunner(session, s.pld if s.kind == "pld" else 0, hf_model)
                hf_model = runner.model
                runners[s.name], info[s.name] = runner, {"kind": s.kind, "rss_added_mb": rss_mb() - before}
                continue
            if s.kind == "llamacpp":
                peer = llamacpp.build_runner(session, s, loaded)
                runners[s.name] = peer
                info[s.name] = {"kind": "llamacpp", "llamacpp": peer.config, "rss_added_mb": rss_mb() - before}
                continue
            if s.kind == "ar":
                runners[s.name] = engine_runner(session.decoder(), False)
                info[s.name] = {"kind": "ar", "rss_added_mb": rss_mb() - before}
                continue
            drafter, where = method_drafter(session, s.drafter, drafters, loaded)
            head = s.head
            if s.drafter == "lowrank" and getattr(drafter, "low_rank_head", None) is None and head == "lowrank":
                d = drafter.head_weight(session.target)[0].shape[1]
                head = f"lowrank:{max(1, d // 8)}"  # no trained low-rank drafter: SVD factors at d/8
            tuned = None
            if s.tree is None:  # --tree auto: this drafter + head's tuning (measured now if not cached), once
                tuned = resolve(session, drafter, head)
                s.tree = tuned.tree
            dec = session.decoder(drafter, head, AUTO_TREE if tuned else s.tree, GuardConfig(enabled=guard))
            runners[s.name] = engine_runner(dec, True)
            info[s.name] = {
                "kind": "spec",
                "head": type(dec.head).__name__ + f" ({head})",
                "drafter": where,
                "tree": vars(s.tree),
                "extra_bytes": int(dec.head.extra_bytes()),
                "drafter_bytes": sum(p.numel() * p.element_size() for p in drafter.parameters()),
                "rss_added_mb": rss_mb() - before,  # what building it added (a drafter counts once, first use)
            }
            info[s.name]["tree_spec"] = str(s.tree)
            if tuned is not None:  # the method keeps its name; its tree is here, in config.trees and in the table
                info[s.name]["tree_auto"] = {
                    "tree": str(tuned.tree),
                    "gather": tuned.gather,
                    "reason": tuned.reason,
                    "fallback": tuned.fallback,
                    "cache": str(tuned.path) if tuned.path else None,
                }
        except SpecheadError as e:
            skipped[s.name] = str(e)
            log(f"skipping {s.name}: {e}")
    for s in specs:  # `lowrank` may decode the EAGLE-2 or EAGLE-3 drafter itself: then that is its twin
        if s.drafter == "lowrank" and "lowrank" in loaded:
            same = [k for k in ("eagle2", "eagle3") if k in loaded and loaded[k][0] is loaded["lowrank"][0]]
            s.twin = same[0] if same else None
    return runners, info, skipped


def method_drafter(session: Session, kind: str, specs: dict[str, str], cache: dict[str, Any]) -> tuple[Any, str]:
    """(drafter, where it came from) for eagle2 / eagle3 / lowrank; ``demo`` is the drafter shipped for the
    target (a seeded random one where none ships, tau ~ 1). Where no low-rank drafter ships, ``lowrank``
    decodes the EAGLE-2 drafter when it carries a fitted low-rank head, else the EAGLE-3 drafter with an SVD
    head: either way its full-head twin is the same drafter, so the nu / rho_tau comparison stays fair."""
    if kind in cache:
        return cache[kind]
    spec = specs.get(kind, "demo")
    arch = specs.get("arch", "eagle2") if kind == "eagle2" else "eagle3"  # --arch eagle3: 'eagle' on EAGLE-3
    target_cfg = session.target.config
    if spec == "demo" and kind == "lowrank" and shipped_drafter_path(LOWRANK_DEMO, target_cfg) is None:
        drafter, where = method_drafter(session, "eagle2", specs, cache)
        if getattr(drafter, "low_rank_head", None) is not None:
            cache[kind] = (drafter, where + " (its fitted low-rank head)")
            return cache[kind]
        drafter, where = method_drafter(session, "eagle3", specs, cache)
        cache[kind] = (drafter, where + " (no low-rank drafter: SVD factors of its head)")
        return cache[kind]
    if spec == "demo":
        path = shipped_drafter_path(LOWRANK_DEMO if kind == "lowrank" else arch, target_cfg)
        spec = str(path) if path else "random"
    where = spec if spec != "random" else f"random {arch} (seed 0)"
    key = ("drafter", spec if spec != "random" else f"random:{arch}")  # one object per folder, whatever the kind
    if key not in cache:
        cache[key] = resolve_drafter(spec, session.target, arch)
    cache[kind] = (cache[key], where)
    return cache[kind]
