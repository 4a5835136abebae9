"""Load test of ``spechead serve`` with and without batching: N concurrent clients on the official ``openai``
client (streaming and not, some disconnecting mid-stream), throughput, p50 / p99 latency, nothing lost, memory
back to its baseline after.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/load_test.py --max-batch 16,1 --clients 16 --head full \
        --out runs/load_test.json

Each configuration runs in its own server process (demo target, the shipped EAGLE-2 drafter, ``--head``,
``--tree auto``); the same load goes to each: every client sends ``--rounds`` requests in turn, alternating a
streamed and a non-streamed one, and every fourth client drops its first stream after two deltas. Completed
greedy answers are checked against the engine's own AR decoding of the same prompt. Prints one line per
configuration and the ratio of the best to ``--max-batch 1``; writes the JSON and each server's log beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from spechead.bench.suites import load_suite, round_robin
from spechead.cli.bench import default_eval_dir
from spechead.decoding.session import Session
from spechead.tuning.measure import cpu_name

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def serve(max_batch: int, head: str, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "spechead.cli", "serve", "--port", str(port), "--max-batch", str(max_batch)]
    cmd += ["--head", head, "--queue-size", "64", "--max-len", "2048", "--threads", str(threads)]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=5).json()["status"] == "ok":
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > 600:
            raise RuntimeError("server did not start")
        time.sleep(0.2)


def prefill_seconds(url: str) -> float:
    """The server's prefill time so far (``spechead_prefill_seconds_total``)."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("spechead_prefill_seconds_total"):
            return float(line.split()[-1])
    return float("nan")


def run_load(url: str, prompts: list[str], clients: int, rounds: int, max_tokens: int) -> dict:
    results, lock = [], threading.Lock()

    def client_loop(c: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for r in range(rounds):
            prompt = prompts[(c * rounds + r) % len(prompts)]
            mode = "drop" if c % 4 == 3 and r == 0 else ("stream" if r % 2 == 0 else "json")
            msgs = [{"role": "user", "content": prompt}]
            t0, first, text, n, outcome = time.perf_counter(), None, "", 0, "ok"
            try:
                if mode == "json":
                    resp = client.chat.completions.create(
                        model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0
                    )
                    text, n = resp.choices[0].message.content, resp.usage.completion_tokens
                else:
                    stream = client.chat.completions.create(
                        model=MODEL, messages=msgs, max_tokens=max_tokens, temperature=0, stream=True,
                        stream_options={"include_usage": True},
                    )  # fmt: skip
                    deltas = 0
                    for chunk in stream:
                        if chunk.usage is not None:
                            n = chunk.usage.completion_tokens
                        for ch in chunk.choices:
                            if ch.delta.content:
                                first = first or time.perf_counter()
                                text += ch.delta.content
                                deltas += 1
                        if mode == "drop" and deltas == 2:
                            stream.close()
                            outcome = "dropped"
                            break
            except openai.APIError as e:
                outcome = f"error {type(e).__name__}: {e}"
            with lock:
                results.append({
                    "client": c, "round": r, "mode": mode, "prompt": prompt, "outcome": outcome, "text": text,
                    "tokens": n, "latency_s": time.perf_counter() - t0,
                    "ttft_s": (first - t0) if first else None,
                })  # fmt: skip

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client_loop, range(clients)))
    wall = time.perf_counter() - t0
    done = [r for r in results if r["outcome"] == "ok"]
    lat = sorted(r["latency_s"] for r in done)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, round(q * (len(lat) - 1)))] if lat else float("nan")

    return {
        "wall_s": wall,
        "requests": len(results),
        "completed": len(done),
        "dropped": sum(r["outcome"] == "dropped" for r in results),
        "errors": [r["outcome"] for r in results if r["outcome"] not in ("ok", "dropped")],
        "completion_tokens": sum(r["tokens"] for r in done),
        "tokens_per_s": sum(r["tokens"] for r in done) / wall,
        "latency_p50_s": pct(0.5),
        "latency_p99_s": pct(0.99),
        "ttft_p50_s": _median([r["ttft_s"] for r in done if r["ttft_s"]]),
        "results": results,
    }


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-batch", default="16,1")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="requests per client, one after the other")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--head", default="nanospec")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/load_test.json")
    args = p.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # the servers' logs go beside it
    rows = round_robin(load_suite("spec-bench", limit=2, eval_dir=default_eval_dir()))
    prompts = [r["turns"][0] for r in rows][: args.clients * args.rounds]
    session = Session.open("demo", max_len=2048)  # the greedy reference: the engine's own AR text
    ar = session.decoder()
    want = {
        q: session.decode(ar.generate(session.encode(q), args.max_tokens, speculative=False).tokens) for q in prompts
    }
    del session, ar
    out = {"cpu": cpu_name(), "threads": args.threads, "clients": args.clients, "rounds": args.rounds,
           "max_tokens": args.max_tokens, "head": args.head, "command": " ".join(sys.argv), "runs": {}}  # fmt: skip
    for mb in [int(x) for x in args.max_batch.split(",")]:
        log = Path(args.out).with_suffix(f".b{mb}.log")
        proc, url = serve(mb, args.head, args.threads, log)
        try:
            warm = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            warm.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            rss0, prefill0 = rss_mib(proc.pid), prefill_seconds(url)
            res = run_load(url, prompts, args.clients, args.rounds, args.max_tokens)
            time.sleep(1.0)
            res["rss_before_mib"], res["rss_after_mib"] = rss0, rss_mib(proc.pid)
            res["health_after"] = httpx.get(url + "/health").json()
            res["wrong_answers"] = sum(r["outcome"] == "ok" and r["text"] != want[r["prompt"]] for r in res["results"])
            metrics = httpx.get(url + "/metrics").text
            res["metrics"] = [m for m in metrics.splitlines() if m.startswith(("spechead_batch", "spechead_prefill"))]
            res["prefill_s"] = prefill_seconds(url) - prefill0  # the serial part: batching cannot share it
        finally:
            proc.terminate()
            proc.wait(30)
        res["traceback_in_log"] = "Traceback" in log.read_text()
        out["runs"][str(mb)] = res
        print(f"--max-batch {mb}: {res['tokens_per_s']:.1f} tok/s total, {res['completed']}/{res['requests']} "
              f"completed, {res['dropped']} dropped, errors {res['errors']}, wrong {res['wrong_answers']}, "
              f"p50 {res['latency_p50_s']:.1f} s, p99 {res['latency_p99_s']:.1f} s, "
              f"prefill {res['prefill_s']:.1f} of {res['wall_s']:.1f} s, "
              f"RSS {rss0:.0f} -> {res['rss_after_mib']:.0f} MiB", flush=True)  # fmt: skip
    runs = out["runs"]
    if "1" in runs and len(runs) > 1:
        best = max((k for k in runs if k != "1"), key=lambda k: runs[k]["tokens_per_s"])
        out["speedup_vs_max_batch_1"] = runs[best]["tokens_per_s"] / runs["1"]["tokens_per_s"]
        print(f"--max-batch {best} / --max-batch 1: {out['speedup_vs_max_batch_1']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
