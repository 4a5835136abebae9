"""NanoSpec inside vLLM at batch 1 and 3 against spechead's engine, on the integration test's three prompts.

    .venv-vllm/bin/python results/vllm/nanospec_batches.py

Prints vLLM's acceptance length (chain of 3, greedy) with the plugin's per-request sets at batch 1 and with the three
prompts in one batch, spechead's engine fed the same sources (``Method.engine_head``) and with every source of the
paper; and whether vLLM's outputs equal its AR outputs. The figures docs/vllm.md quotes.
"""

from __future__ import annotations

import dataclasses
import sys

from spechead.decoding.session import Session
from spechead.integrations.vllm.compare import METHODS, engine_args, export_dir, spechead_run, vllm_config
from spechead.integrations.vllm.run import spawn
from spechead.tuning.measure import cpu_name

sys.path.insert(0, "tests")
from test_vllm_plugin import MAX_NEW, PROMPTS  # noqa: E402  (the integration test's prompts and length)


def main() -> int:
    session = Session.open("demo", max_len=1024)
    prompts = [session.encode(p) for p in PROMPTS]
    method = METHODS["eagle3 + nanospec"]
    base = {"target": str(session.folder), "hf_overrides": {"architectures": ["LlamaForCausalLM"]},
            "prompts": prompts, "batches": [1, len(prompts)], "max_tokens": MAX_NEW}  # fmt: skip
    ar = spawn({**base, "speculative_config": None})["runs"]
    spec = vllm_config(method, export_dir(method, session))
    res = spawn({**base, "speculative_config": spec, "engine_args": engine_args(method)})
    print(f"{cpu_name()}; sets begun: {res['sets_begun']}")
    for b, run in res["runs"].items():
        same = run["outputs"] == ar[b]["outputs"]
        print(f"vLLM batch {b}: AL {run['spec']['acceptance_length']:.3f}, outputs equal vLLM AR: {same}")
    ours = spechead_run(session, method, prompts, MAX_NEW)["acceptance_length"]
    every = spechead_run(session, dataclasses.replace(method, engine_head=""), prompts, MAX_NEW)["acceptance_length"]
    print(f"spechead, vLLM's sources ({method.engine_head}): AL {ours:.3f}")
    print(f"spechead, every source ({method.head}): AL {every:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
