"""Coverage study: hand-made records where every set and every hit can be counted by eye."""

from __future__ import annotations

import json

import pytest

from spechead.bench.coverage import SOURCES, coverage_table, load_records, record_coverage, tokenizer_file
from spechead.errors import SpecheadError


def test_record_coverage_by_hand():
    context, output, ranked = [1, 2, 3], [2, 5, 5, 4, 9], [5, 4, 7, 8]
    cov = record_coverage(context, output, ranked, 2)
    assert cov["static"] == (3, 2)  # {5, 4}: 5, 5, 4
    assert cov["ctx"] == (1, 2)  # the two most recent prompt ids {3, 2}: only 2
    assert cov["ext"] == (1, 2)  # 2 added, 5 added, 5 hit, then the set is full
    assert cov["ctx+ext"] == (1, 2)  # full with {3, 2} from the start: 2 hits, nothing more fits
    assert cov["ctx+ext+top512"] == (3, 2)  # the frequent ids pinned first fill both slots
    assert cov["static@same"] == (3, 2)  # ctx+ext reached 2 ids: the static top-2
    big = record_coverage(context, output, ranked, 10)
    assert big["ctx"] == (1, 3) and big["ext"] == (1, 4) and big["ctx+ext"] == (2, 6)
    assert big["static@same"] == (3, 4)  # ctx+ext reached 6 ids; the list only has 4
    assert big["ctx+ext+top512"] == (4, 8)  # {5,4,7,8} + {3,2,1}, then 9 added: 2, 5, 5, 4 hit


class WordTokenizer:
    """The two calls coverage_table makes of a tokenizers.Tokenizer, over whitespace-separated words."""

    def __init__(self, words):
        self.ids = {w: i for i, w in enumerate(words)}

    def encode_batch(self, texts, add_special_tokens=False):
        class E:
            def __init__(self, ids):
                self.ids = ids

        return [E([self.ids[w] for w in t.split()]) for t in texts]


def test_table_pools_tokens_per_category_merges_mt_and_macro_averages():
    tok = WordTokenizer(["a", "b", "c", "d"])
    records = [
        {"category": "writing", "context": "a b", "output": "a c", "source": "reference"},
        {"category": "stem", "context": "c", "output": "c c d d", "source": "reference"},
        {"category": "qa", "context": "d", "output": "d", "source": "reference"},
    ]
    t = coverage_table(records, tok, ranked=[3, 2, 1, 0], sizes=[1])["1"]
    assert t["writing"]["ctx"] == 0.0 and t["stem"]["ctx"] == 0.5 and t["qa"]["ctx"] == 1.0
    assert t["MT"]["tokens"] == 6 and t["MT"]["ctx"] == pytest.approx(2 / 6)  # pooled over the group's tokens
    assert t["MT"]["static"] == pytest.approx(2 / 6)  # top-1 = {d}
    assert t["overall"]["ctx"] == pytest.approx((2 / 6 + 1.0) / 2)  # MT counts once, as a group
    assert set(SOURCES) <= set(t["overall"])


def test_records_use_references_then_turn_two_then_a_prompt_split(tmp_path):
    suite = tmp_path / "s.jsonl"
    rows = [
        {"category": "rag", "turns": ["passage?"], "reference": [["x", "y"], ["z"]]},
        {"category": "writing", "turns": ["first", "second"]},
        {"category": "qa", "turns": ["abcdef"]},
    ]
    suite.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recs = load_records(str(suite), None, None)
    assert [r["source"] for r in recs] == ["reference", "turn 2", "prompt split"]
    assert recs[0]["output"] == "x\ny\nz" and recs[1]["context"] == "first" and recs[2]["output"] == "def"
    assert [r["category"] for r in load_records(str(suite), None, ["MT"])] == ["writing"]


def test_bad_tokenizer_is_a_one_line_error(tmp_path):
    with pytest.raises(SpecheadError, match="tokenizer not found"):
        tokenizer_file(str(tmp_path / "nope.json"))
