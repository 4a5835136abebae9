"""The prompts of a prompt file (``scripts/training_prompts.py``'s) that no earlier reply file answered, so that a
new generation adds new questions rather than repeating earlier ones (gen-data's order is a seeded shuffle of the
whole file, so a new seed alone would redo a share of the questions already answered).

    python scripts/unused_prompts.py PROMPTS.jsonl.gz OUT.jsonl.gz REPLIES.jsonl.gz...
"""

import argparse
import gzip
import json


def first_user_turn(rec: dict) -> str:
    return next(m["content"] for m in rec["messages"] if m["role"] == "user")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", help="the prompt file (gzip JSONL of {source, messages})")
    p.add_argument("out", help="where the unanswered prompts go (gzip JSONL)")
    p.add_argument("replies", nargs="*", help="earlier gen-data outputs (gzip JSONL)")
    a = p.parse_args()
    prompts, out, replies = a.prompts, a.out, a.replies
    seen = set()
    for path in replies:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            seen.update(first_user_turn(json.loads(line)) for line in f if line.strip())
    kept = total = 0
    with gzip.open(prompts, "rt", encoding="utf-8") as f, gzip.open(out, "wt", encoding="utf-8") as g:
        for line in f:
            if not line.strip():
                continue
            total += 1
            if first_user_turn(json.loads(line)) not in seen:
                g.write(line if line.endswith("\n") else line + "\n")
                kept += 1
    print(f"{kept} of {total} prompts unanswered by {len(seen)} earlier replies -> {out}")


if __name__ == "__main__":
    main()
