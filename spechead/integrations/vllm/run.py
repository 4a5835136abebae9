"""Run one vLLM configuration on token-id prompts in a fresh process and report outputs, speed and acceptance.

One process per configuration (``spawn``) because vLLM's CPU backend wants its allocator and OpenMP runtime
preloaded before the interpreter starts (``vllm_env``: tcmalloc and the venv's libiomp5 in ``LD_PRELOAD``,
threads bound to the cores given) and because an engine does not hand its memory back within a process. The
engine runs in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the plugin's head-call counter
(``model.HEAD_CALLS``) is read directly after generating.

A job is a JSON dict: ``target`` (a transformers folder), ``prompts`` (lists of token ids), ``batches`` (e.g.
[1, 8]: requests per ``generate`` call), ``max_tokens``, ``speculative_config`` (None for AR), ``enforce_eager``,
``repeats`` (passes over the prompts per batch size: tok/s is their median, since one short pass alone is too
noisy to compare engines by).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def vllm_env(cores: str | None = None) -> dict[str, str]:
    """The environment a vLLM CPU process should start with (the issue's set-up pitfalls, applied once)."""
    env = dict(os.environ)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    for pattern in ("/usr/lib/*/libtcmalloc_minimal.so.4", "/usr/lib/*/libtcmalloc.so.4"):
        found = sorted(glob.glob(pattern))
        if found and not any("tcmalloc" in p for p in preload):
            preload.insert(0, found[0])
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.is_file() and not any("iomp" in p for p in preload):
        preload.append(str(iomp))
    env["LD_PRELOAD"] = ":".join(preload)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cores or f"0-{(os.cpu_count() or 1) - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the demo target needs little
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def spawn(
    job: dict[str, Any], timeout_s: float = 900, cores: str | None = None, script: str | None = None
) -> dict[str, Any]:
    """Run ``job`` in a new interpreter of this venv; raise with its log tail when it fails. ``script``: a file
    run in place of this module (same arguments: job and result paths), for an experiment that patches vLLM first."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        runner = [script] if script else ["-m", "spechead.integrations.vllm.run"]
        cmd = [sys.executable, *runner, str(job_path), str(out_path)]
        proc = subprocess.run(cmd, env=vllm_env(cores), capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"vLLM job failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        return json.loads(out_path.read_text())


def _spec_counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {k: 0 for k in SPEC_COUNTERS}
    out["per_pos"] = []
    for m in llm.get_metrics():
        key = m.name.removeprefix("vllm:spec_decode_num_")
        if key in SPEC_COUNTERS:
            out[key] = int(m.value)
        elif key == "accepted_tokens_per_pos":
            out["per_pos"] = list(m.values)
    return out


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    pos = [a - (before["per_pos"][i] if i < len(before["per_pos"]) else 0) for i, a in enumerate(after["per_pos"])]
    d["acceptance_length"] = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None
    d["per_pos_rate"] = [p / d["drafts"] for p in pos] if d["drafts"] else []
    return d


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Build the engine, warm it up, then time each batch size over every prompt (greedy)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=job["target"],
        dtype="float32",
        max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=max(job["batches"]),
        enforce_eager=job.get("enforce_eager", True),
        speculative_config=job.get("speculative_config"),
        hf_overrides=job.get("hf_overrides"),
        disable_log_stats=False,
        seed=0,
        **job.get("engine_args", {}),
    )
    load_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=job.get("ignore_eos", False))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    result: dict[str, Any] = {"load_s": load_s, "runs": {}}
    for batch in job["batches"]:
        before, passes, walls = _spec_counters(llm), [], []
        for _ in range(job.get("repeats", 1)):
            outputs, t = [], time.perf_counter()
            for i in range(0, len(prompts), batch):
                outs = llm.generate(prompts[i : i + batch], greedy, use_tqdm=False)
                outputs += [list(o.outputs[0].token_ids) for o in outs]
            walls.append(time.perf_counter() - t)
            passes.append(outputs)
        new, wall = sum(len(o) for o in passes[0]), statistics.median(walls)
        result["runs"][str(batch)] = {
            "outputs": passes[0],
            "same_every_pass": all(p == passes[0] for p in passes),
            "new_tokens": new,
            "wall_s": wall,
            "tok_s": new / wall,
            "tok_s_passes": [new / w for w in walls],
            "spec": _delta(_spec_counters(llm), before),
        }
    try:
        from spechead.integrations.vllm.model import HEAD_CALLS, LOOKUP_TOKENS, SETS_BEGUN

        result["head_calls"], result["sets_begun"] = dict(HEAD_CALLS), SETS_BEGUN[0]
        result["lookup_tokens"] = LOOKUP_TOKENS[0]
    except ImportError:  # vLLM without the plugin's dependencies: nothing to count
        result["head_calls"], result["sets_begun"], result["lookup_tokens"] = {}, 0, 0
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("job", help="job JSON file")
    p.add_argument("out", help="result JSON file")
    args = p.parse_args(argv)
    res = run_job(json.loads(Path(args.job).read_text()))
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
