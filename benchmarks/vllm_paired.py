"""vLLM with a spechead drafter against vLLM AR as paired ratios, so that the host's drift between processes cancels.

One vLLM process per configuration (``run.spawn``), as in vllm_bench.py, but AR and the method alternate in pairs
(AR then method, then method then AR, ...), each process timing every batch size over the same prompts ``--repeats``
times (median). The ratio of a pair is method / AR from two neighbouring processes; the summary is the median of the
pairs' ratios with their range. Single processes per configuration moved vLLM AR by up to 7 % from one process to
the next on a shared 2-core host, as much as the effect measured. Writes the JSON after every process (a stopped
run keeps its pairs) and a Markdown table beside it, and prints the table. From the repository root::

    .venv-vllm/bin/python benchmarks/vllm_paired.py --out runs/vllm_paired.json

Greedy; every output is compared with vLLM AR's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from spechead.decoding.session import Session
from spechead.integrations.vllm.compare import METHODS, export_dir, parse_schedule, vllm_config, vllm_job
from spechead.integrations.vllm.run import spawn
from spechead.tuning.measure import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench import prompts  # noqa: E402  (beside this script: the prompt set of the vLLM comparisons)

AR = "AR"


def summary(res: dict) -> str:
    """The pairs' ratios per batch size, their median and range, acceptance and whether outputs matched AR."""
    lines = [
        "| batch | pairs | method / AR per pair | median | min - max | AR tok/s (median) | method tok/s (median) "
        "| acceptance length | outputs = AR |",
        "|---:|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for b in res["batches"]:
        b = str(b)
        pairs = [p for p in res["pairs"] if AR in p and res["method"] in p]
        if not pairs:
            continue
        ratios = [p[res["method"]]["runs"][b]["tok_s"] / p[AR]["runs"][b]["tok_s"] for p in pairs]
        ar = statistics.median(p[AR]["runs"][b]["tok_s"] for p in pairs)
        ours = statistics.median(p[res["method"]]["runs"][b]["tok_s"] for p in pairs)
        als = [p[res["method"]]["runs"][b]["spec"]["acceptance_length"] for p in pairs]
        al = f"{statistics.median(als):.3f}" if all(als) else "- (no drafts)"
        same = all(p[res["method"]]["runs"][b]["outputs"] == p[AR]["runs"][b]["outputs"] for p in pairs)
        lines.append(
            f"| {b} | {len(pairs)} | {', '.join(f'{r:.3f}' for r in ratios)} | **{statistics.median(ratios):.3f}** | "
            f"{min(ratios):.3f} - {max(ratios):.3f} | {ar:.1f} | {ours:.1f} | {al} | {same} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/vllm_paired.json")
    p.add_argument("--method", default="eagle2 + fr:8192", help="a name from compare.METHODS")
    p.add_argument("--k", type=int, default=1, help="speculative tokens a round")
    p.add_argument("--schedule", default="1-4:1,5-256:0", help="vLLM's chain length by batch size ('' for none)")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="passes over the prompts per batch size and process")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="vLLM eager (default: compiled, vLLM's faster mode)")
    p.add_argument("--child", default="", help="a script run in place of run.py for the method (an experiment)")
    a = p.parse_args()
    if a.method not in METHODS:
        p.error(f"--method must be one of {', '.join(METHODS)}; got {a.method!r}")
    if a.pairs < 1 or a.repeats < 1:
        p.error("--pairs and --repeats must be at least 1")
    torch.set_num_threads(a.threads)
    session = Session.open("demo", max_len=2048)
    ids = prompts(session, a.prompts, 400)
    batches = tuple(int(x) for x in a.batches.split(","))
    method = METHODS[a.method]
    schedule = parse_schedule(a.schedule) if a.schedule else None
    spec = vllm_config(method, export_dir(method, session), a.k, schedule)
    jobs = {
        AR: vllm_job(session, ids, a.max_new_tokens, None, None, batches, a.repeats, not a.eager),
        a.method: vllm_job(session, ids, a.max_new_tokens, spec, method, batches, a.repeats, not a.eager),
    }
    res = {
        "cpu": cpu_name(),
        "threads": a.threads,
        "torch": torch.__version__,
        "method": a.method,
        "k": a.k,
        "schedule": a.schedule,
        "compiled": not a.eager,
        "repeats": a.repeats,
        "batches": list(batches),
        "max_new_tokens": a.max_new_tokens,
        "prompts": ids,
        "child": a.child,
        "pairs": [],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for i in range(a.pairs):
        pair: dict = {}
        res["pairs"].append(pair)
        for name in (AR, a.method) if i % 2 == 0 else (a.method, AR):  # ABBA: drift within a pair cancels over two
            t = time.perf_counter()
            script = a.child if name != AR and a.child else None
            pair[name] = spawn(jobs[name], timeout_s=1500, cores=f"0-{a.threads - 1}", script=script)
            speeds = {b: round(r["tok_s"], 1) for b, r in pair[name]["runs"].items()}
            print(f"pair {i + 1} {name}: tok/s {speeds} ({time.perf_counter() - t:.0f} s)", flush=True)
            out.write_text(json.dumps(res))  # compact: every pass keeps its outputs
    md = summary(res)
    out.with_suffix(".md").write_text(
        f"CPU: {res['cpu']}, {a.threads} threads, torch {res['torch']}; vLLM {'eager' if a.eager else 'compiled'}; "
        f"{len(ids)} prompts x {a.max_new_tokens} new tokens, greedy; {a.method}, chain of {a.k}"
        + (f", chain by batch size {a.schedule}" if a.schedule else "")
        + (f"; the method's processes run {a.child}" if a.child else "")
        + f"; {a.pairs} pairs of processes (AR / method, alternating order), each timing {a.repeats} passes per "
        f"batch size (median)\n\n{md}\n"
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
