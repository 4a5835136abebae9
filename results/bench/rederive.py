"""Re-derive the speedup model and the Llama-3.1-8B projection of a saved `spechead bench` JSON with the
current code, keeping every measured figure as it is, then rewrite the JSON and its report.

Why: the fourth session fixed the projection's head-call count (one root call + depth calls a round,
it had counted depth - 1) and made the model pick each head's full-head reference on its own tree,
while the README benchmark was already running with the previous code.

    python results/bench/rederive.py results/bench/readme/bench.json --report results/bench/readme \
        --heads-json results/heads/llama3.1-8b_bf16_t2.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from spechead.bench.analysis import add_speedup_model
from spechead.bench.harness import write_outputs
from spechead.bench.methods import check_methods
from spechead.bench.projection import project
from spechead.decoding.tree import TreeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a spechead bench JSON (rewritten in place)")
    ap.add_argument("--report", default=None, help="rewrite this report folder too")
    ap.add_argument("--heads-json", required=True, help="the head benchmark the run was projected with")
    args = ap.parse_args()
    out = json.loads(Path(args.json).read_text())
    tree = TreeConfig(**out["config"]["tree"])
    specs = check_methods(list(out["methods"]), tree)
    out["speedup_model"] = add_speedup_model(out["methods"], specs)
    out["projection_llama3.1-8b"] = project(out["methods"], specs, tree, Path(args.heads_json))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out["config"]["rederived"] = f"speedup model and projection recomputed by results/bench/rederive.py at {rev}"
    write_outputs(out, args.json, args.report)


if __name__ == "__main__":
    main()
