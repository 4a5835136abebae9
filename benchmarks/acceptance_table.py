"""Acceptance of drafters side by side, from `spechead bench` JSONs of the same prompts: tau (tokens committed per
round) per tree and drafter, the share of rounds past depth 1..5 on chain:5 (acceptance by depth), and chain:3 per
category. Each file's column is named after it (``acceptance_NAME.json`` -> NAME). Prints Markdown tables.

    .venv/bin/python benchmarks/acceptance_table.py benchmarks/runs/drafter-acceptance/acceptance_{e2,e3,lr72}.json

The JSONs come from ``bash scripts/train_drafters.sh accept`` (chains of 3 and 5 and the 2x4x8 tree, no lookup
branch, the benchmark's held-out prompts, greedy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="spechead bench JSON files, one per drafter")
    paths = p.parse_args().runs
    runs = {Path(p).stem.removeprefix("acceptance_"): json.loads(Path(p).read_text()) for p in paths}
    names = list(runs)
    trees = [m for m in next(iter(runs.values()))["methods"] if m != "ar"]
    print("| tree | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for t in trees:
        cells = [f"{r['methods'][t]['tau']:.3f}" if t in r["methods"] else "-" for r in runs.values()]
        print(f"| {t} | " + " | ".join(cells) + " |")
    mism = {n: sum(m.get("mismatches_vs_ar", 0) for m in r["methods"].values()) for n, r in runs.items()}
    print(f"\nmismatches vs AR: {mism}")
    for n, r in runs.items():
        past = r["methods"].get("eagle@chain:5", {}).get("committed_past")
        if past:
            cond = [past[0]] + [b / a if a else float("nan") for a, b in zip(past, past[1:], strict=False)]
            print(
                f"{n}: past depth 1..5 {[round(x, 3) for x in past]}; acceptance at depth k given k-1: "
                f"{[round(x, 3) for x in cond]}"
            )
    first = next(iter(runs.values()))["methods"]
    if "eagle@chain:3" not in first:
        return
    cats = list(first["eagle@chain:3"]["per_category"])
    print("\nchain:3 per category\n| category | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for c in cats:
        cells = [
            f"{r['methods']['eagle@chain:3']['per_category'].get(c, {}).get('tau', float('nan')):.2f}"
            for r in runs.values()
        ]
        print(f"| {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
