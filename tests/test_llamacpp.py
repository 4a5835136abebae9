"""llama.cpp as a peer in ``spechead bench``: the method names, the one-line refusal where llama-cpp-python is
missing, its agreement with AR kept out of ``mismatches_vs_ar``, and (where the package is installed) a short real
run on the demo target's GGUF."""

from __future__ import annotations

import sys

import pytest

from spechead.bench.harness import bench_loop, make_report_data
from spechead.bench.llamacpp import missing, unavailable
from spechead.bench.methods import MethodSpec, check_methods, expand_methods
from spechead.bench.runs import Run
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError

TREE = TreeConfig(top_k=2, depth=1, total_tokens=4)


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """Make ``import llama_cpp`` fail as it does where llama-cpp-python is not installed."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


def test_method_names_parse():
    plain, lookup, short = (MethodSpec.parse(m, TREE) for m in ("llamacpp", "llamacpp-lookup", "llamacpp-lookup:4"))
    assert (plain.kind, plain.pld) == ("llamacpp", 0)
    assert (lookup.kind, lookup.pld) == ("llamacpp", 10) and short.pld == 4
    specs = check_methods(expand_methods("llamacpp,llamacpp-lookup,ar,nanospec"), TREE)
    assert [s.kind for s in specs] == ["llamacpp", "llamacpp", "ar", "spec"]
    for bad in ("llamacpp-lookup:0", "llamacpp-lookup:x"):
        with pytest.raises(SpecheadError, match="llamacpp-lookup:N"):
            MethodSpec.parse(bad, TREE)


def test_without_the_package_the_refusal_is_one_line(no_llama_cpp, capsys):
    from spechead.cli.commands import main

    reason = missing()
    assert reason is not None and "llama-cpp-python" in reason and "pip install llama-cpp-python" in reason
    specs = check_methods(["llamacpp", "llamacpp-lookup", "ar"], TREE)
    assert unavailable(specs) == {"llamacpp": reason, "llamacpp-lookup": reason}  # ar is not refused
    assert main(["bench", "--methods", "llamacpp,llamacpp-lookup", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"spechead: error: {reason}"]


def test_without_the_package_other_methods_run_and_it_is_skipped(no_llama_cpp, demo_session):
    from spechead.bench.harness import run_bench

    prompts = [{"id": 1, "category": "qa", "turns": ["Say hi."]}]
    out = run_bench(demo_session, prompts, ["llamacpp", "ar"], "random", 2, progress=False, warmup=0)
    assert list(out["methods"]) == ["ar"] and out["config"]["skipped"] == {"llamacpp": missing()}


def test_agreement_with_ar_is_a_share_never_a_mismatch(tmp_path):
    from spechead.bench.report import write_report
    from spechead.cli.bench import format_table

    def runner(tokens):
        return lambda ids, max_new, sampling: Run(list(tokens), 0.5, [1] * (len(tokens) - 1), prefill_s=0.1)

    runners = {"ar": runner([5, 6, 7]), "llamacpp": runner([5, 6, 8]), "eagle": runner([5, 6, 7])}
    prompts = [{"id": 1, "category": "qa", "turns": ["a"]}, {"id": 2, "category": "code", "turns": ["b"]}]
    encode = lambda messages: [len(messages)]  # noqa: E731
    results = bench_loop(runners, prompts, encode, str, 3, SamplingConfig(), progress=False, warmup=0)
    specs = [MethodSpec.parse(m, TREE) for m in runners]
    out = make_report_data(results, prompts, specs, SamplingConfig(), TREE)
    lc = out["methods"]["llamacpp"]
    assert "mismatches_vs_ar" not in lc and lc["same_output_as_ar"] == 0.0
    assert out["methods"]["eagle"]["mismatches_vs_ar"] == 0
    assert lc["per_prompt"][0]["tokens"] == [5, 6, 8] and out["methods"]["ar"]["per_prompt"][1]["tokens"] == [5, 6, 7]
    assert lc["decode_tokens_per_s"] == pytest.approx(2 / 0.4)  # the first token comes from the prefill
    out["config"]["max_new_tokens"] = 3
    assert "llamacpp: output equal to ar's on 0% of prompts" in format_table(out)
    assert "llamacpp" in write_report(out, tmp_path).read_text()


def test_llamacpp_runs_the_demo_gguf(demo_session):
    pytest.importorskip("llama_cpp")
    from spechead.bench.harness import run_bench

    prompts = [{"id": 1, "category": "qa", "turns": ["Name a primary colour."]}]
    out = run_bench(
        demo_session, prompts, ["ar", "llamacpp", "llamacpp-lookup"], "random", 4, progress=False, warmup=0
    )  # fmt: skip
    assert not out["config"]["skipped"], out["config"]["skipped"]
    for name in ("llamacpp", "llamacpp-lookup"):
        m = out["methods"][name]
        assert 1 <= m["new_tokens"] <= 4 and m["tokens_per_s"] > 0 and m["decode_tokens_per_s"] > 0
        assert "mismatches_vs_ar" not in m and 0.0 <= m["same_output_as_ar"] <= 1.0
        assert m["llamacpp"]["gguf"].endswith(".gguf") and m["llamacpp"]["use_extra_bufts_set_by"]
    assert out["methods"]["llamacpp-lookup"]["tau"] >= 1.0 and out["methods"]["llamacpp"]["tau"] == 1.0
