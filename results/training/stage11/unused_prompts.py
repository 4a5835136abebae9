"""The prompts of a prompt file (results/training/stage9/prompts.py's) that no earlier stage's replies answered, so
that a new stage's generation adds new questions rather than repeating earlier ones (gen-data's order is a seeded
shuffle of the whole file, so a new seed alone would redo about a sixth of the questions stage 9 and 10 answered).

    python results/training/stage11/unused_prompts.py PROMPTS.jsonl.gz OUT.jsonl.gz REPLIES.jsonl.gz...
"""

import gzip
import json
import sys


def first_user_turn(rec: dict) -> str:
    return next(m["content"] for m in rec["messages"] if m["role"] == "user")


def main() -> None:
    prompts, out, replies = sys.argv[1], sys.argv[2], sys.argv[3:]
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
