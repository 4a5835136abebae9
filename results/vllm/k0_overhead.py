"""What vLLM's speculative decoding costs when it drafts nothing (issue 16's batch-8 bar).

With ``num_speculative_tokens_per_batch_size`` giving K = 0 from batch 5 on, vLLM + spechead's EAGLE-2 drafter ran at
0.88-0.89x vLLM AR at batch 8 (docs/vllm.md). This separates the two costs left at K = 0 on the same prompts in one
session: vLLM's n-gram proposer (no drafter model: only the spec-decode bookkeeping) and the EAGLE-2 drafter with
fr:8192 (bookkeeping plus the drafter's forward that keeps its KV cache in step). At 6772f01 the plugin could also skip
that pass in a decode step at K = 0 (the "pass skipped" row of results/vllm/s27_k0_overhead.md); it measured no gain
and was taken out. Run from the repository root::

    .venv-vllm/bin/python results/vllm/k0_overhead.py --out results/vllm/s27_k0_overhead.json

Greedy; every output is compared with vLLM AR's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spechead.decoding.session import Session
from spechead.integrations.vllm.compare import METHODS, export_dir, parse_schedule, vllm_config, vllm_job
from spechead.integrations.vllm.run import spawn
from spechead.tuning.measure import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import prompts  # noqa: E402  (the benchmark's prompt set)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/vllm/k0_overhead.json")
    p.add_argument("--schedule", default="1-4:1,5-256:0")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="", help="comma-separated names of the configurations to run (default: all)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    session = Session.open("demo", max_len=2048)
    ids = prompts(session, 8, 400)
    schedule = parse_schedule(a.schedule)
    batches = tuple(int(x) for x in a.batches.split(","))
    fr = METHODS["eagle2 + fr:8192"]
    configs = {
        "AR": None,
        "ngram (K=0 from batch 5)": {
            "method": "ngram",
            "num_speculative_tokens": 1,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 3,
            "num_speculative_tokens_per_batch_size": [list(s) for s in schedule],
        },
        "eagle2 + fr:8192 (K=0 from batch 5)": vllm_config(fr, export_dir(fr, session), 1, schedule),
    }
    names = [n.strip() for n in a.configs.split(",")] if a.configs else list(configs)
    runs = {}
    for name in names:
        job = vllm_job(session, ids, 80, configs[name], batches=batches, repeats=a.repeats, compiled=True)
        runs[name] = spawn(job, timeout_s=1500, cores=f"0-{a.threads - 1}")
        print(name, {b: round(r["tok_s"], 1) for b, r in runs[name]["runs"].items()}, flush=True)
    ar = runs["AR"]["runs"]
    lines = ["| vLLM config | " + " | ".join(f"b{b} tok/s | b{b} x AR | b{b} same as AR" for b in ar) + " |"]
    lines.append("|---|" + "---:|---:|---|" * len(ar))
    for name, r in runs.items():
        cells = [
            f"{r['runs'][b]['tok_s']:.1f} | {r['runs'][b]['tok_s'] / ar[b]['tok_s']:.2f} | "
            f"{r['runs'][b]['outputs'] == ar[b]['outputs']}"
            for b in ar
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    md = "\n".join(lines)
    out = Path(a.out)
    out.write_text(json.dumps({"cpu": cpu_name(), "threads": a.threads, "torch": torch.__version__,
                               "schedule": a.schedule, "prompts": ids, "runs": runs}, indent=1))  # fmt: skip
    out.with_suffix(".md").write_text(
        f"CPU: {cpu_name()}, {a.threads} threads; vLLM compiled, 8 prompts x 80 new tokens, greedy, median of "
        f"{a.repeats} passes, chain of 1 with K by batch size {a.schedule}\n\n{md}\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
