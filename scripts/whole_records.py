"""Keep the whole records of a JSONL file that a clock stopped mid-write (``timeout ... spechead gen-data``): a torn
last line is dropped, so gen-data resumes after the records kept and training reads only whole ones.

    python scripts/whole_records.py FILE.jsonl
"""

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="the JSONL file, rewritten in place")
    path = p.parse_args().path
    lines = open(path, encoding="utf-8").read().splitlines()
    good = []
    for line in lines:
        try:
            json.loads(line)
            good.append(line)
        except json.JSONDecodeError:
            pass
    open(path, "w", encoding="utf-8").write("".join(g + "\n" for g in good))
    print(f"{len(good)} records kept of {len(lines)} lines")


if __name__ == "__main__":
    main()
