"""Where a vLLM decode step's time goes: vLLM AR against vLLM with a spechead drafter, one batch size.

Each configuration runs in its own process (as ``run.spawn``: vLLM's CPU environment, the engine in-process), with
timers wrapped around vLLM's model runner (``execute_model``, the target's ``_model_forward``, ``sample_tokens``,
``propose_draft_token_ids``), the proposer's ``propose`` (the drafter's forward and head) and the plugin's head. The
per-call means say what a speculative step adds to an AR step: the verification rows, the drafter's pass, vLLM's
spec-decode bookkeeping. From the repository root::

    .venv-vllm/bin/python benchmarks/vllm_step_profile.py --batch 8 --schedule 1-4:1,5-256:0
    .venv-vllm/bin/python benchmarks/vllm_step_profile.py --batch 1 --method "eagle2 + fr:8192 + lookup"

Prints each configuration's tok/s and, per timed method, its calls and ms per call (``--out``: also a JSON).

Timers add a few microseconds a call; compare the configurations, not the absolute tok/s with other runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

TIMED = {  # (module, class, method) -> label
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"): "execute_model",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward"): "  target forward",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "sample_tokens"): "sample_tokens",
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "propose_draft_token_ids"): "  propose (runner)",
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", "propose"): "    drafter propose",
    ("spechead.integrations.vllm.model", "SpecheadDraftHead", "get_top_tokens"): "      spechead head",
}


def child(job_path: str, out_path: str) -> None:
    """In the vLLM process: wrap the timed methods, run the job, write timings and speeds."""
    import importlib

    from spechead.integrations.vllm.run import run_job

    total: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()

    def timed(f, label):
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                total[label] += time.perf_counter() - t
                calls[label] += 1

        return g

    for (mod, cls, name), label in TIMED.items():
        c = getattr(importlib.import_module(mod), cls)
        setattr(c, name, timed(getattr(c, name), label))
    res = run_job(json.loads(Path(job_path).read_text()))
    (run,) = res["runs"].values()
    ms = {label: {"calls": calls[label], "ms_per_call": 1e3 * total[label] / calls[label]} for label in calls}
    Path(out_path).write_text(json.dumps({"tok_s": run["tok_s"], "tok_s_passes": run["tok_s_passes"],
                                          "spec": run["spec"], "ms": ms}))  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="eagle2 + fr:8192", help="a name from compare.METHODS")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--schedule", default="", help="vLLM's chain length by batch size, e.g. 1-4:1,5-256:0")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="", help="JSON to write (default: print only)")
    a = p.parse_args()

    import torch

    from spechead.decoding.session import Session
    from spechead.integrations.vllm.compare import METHODS, export_dir, parse_schedule, vllm_config, vllm_job
    from spechead.integrations.vllm.run import spawn
    from spechead.tuning.measure import cpu_name

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_bench import prompts  # beside this script: the prompt set of the vLLM comparisons

    session = Session.open("demo", max_len=2048)
    ids = prompts(session, 8, 400)
    method = METHODS[a.method]
    schedule = parse_schedule(a.schedule) if a.schedule else None
    spec = vllm_config(method, export_dir(method, session), a.k, schedule)
    jobs = {
        "AR": vllm_job(session, ids, 80, None, None, (a.batch,), a.repeats, True),
        a.method: vllm_job(session, ids, 80, spec, method, (a.batch,), a.repeats, True),
    }
    res = {"cpu": cpu_name(), "threads": a.threads, "torch": torch.__version__, "batch": a.batch, "k": a.k,
           "schedule": a.schedule, "runs": {}}  # fmt: skip
    for name, job in jobs.items():
        res["runs"][name] = r = spawn(job, timeout_s=1500, cores=f"0-{a.threads - 1}", script=__file__)
        print(f"{name}: {r['tok_s']:.1f} tok/s (passes {[round(x, 1) for x in r['tok_s_passes']]})")
        for label, m in r["ms"].items():
            print(f"  {label:24s} {m['calls']:6d} calls {m['ms_per_call']:8.2f} ms/call")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and not sys.argv[1].startswith("-"):  # run.spawn's child: job and result paths
        child(sys.argv[1], sys.argv[2])
        sys.exit(0)
    sys.exit(main())
