"""A kernel change timed against another revision's kernels in one process: a target's decode step (and a few-row
verification) with this checkout's ops and with the revision's, taking turns in blocks of --steps forwards over
--repeats rounds; the medians, their ratio, and whether the two builds give bitwise the same hidden states.

On a shared host whose speed drifts by 10-30 % between runs, two processes timed one after the other cannot show a
5 % change; steps interleaved in one process can. The revision's ``spechead/kernels/csrc`` (``git archive``) is built
for the active instruction set under its own op namespace, so its ops must take the arguments this checkout's
Python passes them (the same op schemas).

    .venv/bin/python benchmarks/kernel_ab.py --base-rev 12cb214 --context 200 --rows 1,4
"""

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import torch

from spechead import kernels
from spechead.cache import cache_dir
from spechead.decoding.session import Session
from spechead.tuning.measure import machine_facts

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--base-rev", required=True, help="the git revision whose kernels to compare against")
p.add_argument("--target", default="demo")
p.add_argument("--context", type=int, default=200, help="tokens already in the cache")
p.add_argument("--rows", default="1,4", help="rows a forward: 1 is a decode step, more a verification")
p.add_argument("--steps", type=int, default=20, help="forwards a block, before the other build's turn")
p.add_argument("--repeats", type=int, default=15, help="blocks per build and row count")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--out", help="JSON file to write")
args = p.parse_args()
torch.set_num_threads(args.threads)
if not kernels.available():
    raise SystemExit(f"no kernel build to compare: {kernels.unavailable_reason()}")

root = Path(__file__).resolve().parent.parent
sha = subprocess.run(["git", "rev-parse", args.base_rev], cwd=root, check=True, capture_output=True, text=True)
sha = sha.stdout.strip()
folder = cache_dir() / "kernel-ab" / sha[:12]
if not folder.is_dir():
    tar = subprocess.run(["git", "archive", sha, "spechead/kernels/csrc"], cwd=root, check=True, capture_output=True)
    with tarfile.open(fileobj=BytesIO(tar.stdout)) as t:
        t.extractall(folder, filter="data")
builds = {"base": kernels.library_from(folder / "spechead/kernels/csrc", "spechead_base"), "new": kernels.ops()}

model = Session.open(args.target, 2048, dtype="gguf").target
model.prepack()
rows = [int(r) for r in args.rows.split(",")]
ids = torch.randint(0, 1000, (args.context + max(rows),), generator=torch.Generator().manual_seed(0))
times: dict[tuple[str, int], list[float]] = {(b, r): [] for b in builds for r in rows}
hidden = {}
with torch.inference_mode():
    for name, lib in builds.items():
        with kernels.using(lib):
            model(ids[: args.context], 0, logits_rows=None)  # each build writes the cache it reads
            hidden[name] = model(ids[args.context : args.context + max(rows)], args.context).hidden
    for _ in range(args.repeats):
        for name, lib in builds.items():
            with kernels.using(lib):
                for r in rows:
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        model(ids[args.context : args.context + r], args.context)
                        times[(name, r)].append(time.perf_counter() - t0)

result = {
    "command": " ".join(["python benchmarks/kernel_ab.py", *sys.argv[1:]]),
    "machine": machine_facts(args.threads),
    "kernels": kernels.active_isa(),
    "base": sha,
    "same_hidden": bool(torch.equal(hidden["base"], hidden["new"])),
    "ms": {name: {r: round(statistics.median(times[(name, r)]) * 1e3, 3) for r in rows} for name in builds},
}
result["new_x_base"] = {r: round(result["ms"]["new"][r] / result["ms"]["base"][r], 3) for r in rows}
print(json.dumps(result, indent=1))
if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result))
