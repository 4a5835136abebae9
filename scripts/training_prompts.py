"""The drafters' training prompts: the first user turn(s) of every chat record of ../shared/data/train in the
benchmark's categories (none of its prompts: the data folder has them removed), at most --max-chars characters,
one gzip JSONL of ``{"source", "messages"}`` records for ``spechead gen-data``. Small enough to travel to a GPU
machine. Prints the count per source and the total.

    .venv/bin/python scripts/training_prompts.py --out .gpu/prompts.jsonl.gz
"""

import argparse
import gzip
import json
from pathlib import Path

from spechead.training.data import prompt_of, read_jsonl

SOURCES = [
    "chat_sharegpt", "chat_alpacaeval", "chat_gpteacher", "chat_arenahard", "code_instruct", "math_gsm8k_train",
    "math_MATH", "summ_t0_news", "summ_scitldr", "mt_de_en", "qa_nq_open", "qa_t0_context",
]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="../shared/data/train")
    p.add_argument("--out", required=True)
    p.add_argument("--max-chars", type=int, default=2400)
    args = p.parse_args()
    seen, counts = set(), {}
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for name in SOURCES:
            for i, rec in enumerate(read_jsonl(Path(args.data) / f"{name}.jsonl.gz")):
                turns = prompt_of(rec, f"{name} {i}")
                if not turns:
                    continue
                key = json.dumps(turns)
                if len(key) > args.max_chars or key in seen:
                    continue
                seen.add(key)
                f.write(json.dumps({"source": name, "messages": turns}, ensure_ascii=False) + "\n")
                counts[name] = counts.get(name, 0) + 1
    print(json.dumps(counts), sum(counts.values()))


if __name__ == "__main__":
    main()
