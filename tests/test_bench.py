"""The benchmark harness: suites, MT two-turn prompts, aggregation, the speedup model, the report, Ctrl-C.

Most tests drive ``bench_loop`` with scripted runners (exact, fast); one runs the real engine on the
demo model to check the whole path, including losslessness across both turns of an MT-bench prompt.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from spechead.bench.analysis import add_speedup_model, committed_past
from spechead.bench.harness import bench_loop, make_report_data, write_outputs
from spechead.bench.methods import MethodSpec, expand_methods
from spechead.bench.projection import project
from spechead.bench.report import nanospec_w_max, write_report
from spechead.bench.runners import run_prompt
from spechead.bench.runs import Run
from spechead.bench.suites import MT_BENCH, load_suite
from spechead.cli.bench import default_eval_dir
from spechead.decoding.sampling import SamplingConfig
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.tuning.speedup import speedup_model

TREE = TreeConfig(top_k=4, depth=4, total_tokens=16)
FIRST_KEYS = {
    "prompts",
    "tokens_per_s",
    "tokens_per_s_median",
    "new_tokens",
    "tau",
    "round_ms",
    "per_category",
    "speedup_vs_ar",
    "speedup_vs_hf",
}


def encode(messages):
    """A fake chat encoder: one id per character count of each message (enough to tell turns apart)."""
    return [len(m["content"]) % 50 + 1 for m in messages]


def decode(tokens):
    return " ".join(map(str, tokens))


class Scripted:
    """A runner returning a fixed answer per call; wall time and per-round timers are made up but exact."""

    def __init__(self, tokens, wall, accept, timers=None, head_stats=None, trace=None, fail_at=None):
        self.tokens, self.wall, self.accept = tokens, wall, accept
        self.timers, self.head_stats, self.trace = timers or {}, head_stats or {}, trace or []
        self.calls, self.seen, self.fail_at = 0, [], fail_at

    def __call__(self, ids, max_new, sampling):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise KeyboardInterrupt
        self.seen.append(list(ids))
        return Run(
            list(self.tokens), self.wall, list(self.accept), dict(self.timers), dict(self.head_stats), 0.01,
            list(self.trace),
        )  # fmt: skip


PROMPTS = [
    {"id": 1, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
    {"id": 2, "category": "roleplay", "turns": ["Be a pirate.", "Say hi."]},
    {"id": 3, "category": "qa", "turns": ["Capital of France?"]},
]


def fake_run(interrupt_at=None):
    spec_timers = {"backbone": 2.0, "head": 4.0, "gather": 0.0, "verify": 6.0}
    nano_timers = {"backbone": 2.0, "head": 0.5, "gather": 0.5, "verify": 6.0}
    trace = [{"active": 100.0, "coverage": 0.5}, {"active": 120.0, "coverage": 0.75}]
    runners = {
        "hf": Scripted([5, 6, 7, 8], 2.0, [1, 1, 1]),
        "ar": Scripted([5, 6, 7, 8], 1.0, [1, 1, 1]),
        "eagle": Scripted([5, 6, 7, 8], 0.5, [2, 2], spec_timers, fail_at=interrupt_at),
        "nanospec": Scripted([5, 6, 7, 8], 0.4, [2, 2], nano_timers, {"active_size": 120.0, "coverage": 0.75}, trace),
    }
    results = bench_loop(runners, PROMPTS, encode, decode, 8, SamplingConfig(), progress=False, warmup=0)
    specs = [MethodSpec.parse(m, TREE) for m in runners]
    return runners, make_report_data(results, PROMPTS, specs, SamplingConfig(), TREE)


def test_json_keeps_first_version_keys_and_adds_the_new_ones():
    _, out = fake_run()
    assert out["config"]["prompts"] == 3 and out["config"]["interrupted"] is False
    for name, m in out["methods"].items():
        assert FIRST_KEYS <= set(m), name
        assert {"decode_tokens_per_s", "tau_median", "per_prompt", "prefill_ms"} <= set(m)
        assert m["mismatches_vs_ar"] == 0
    m = out["methods"]["eagle"]
    # two turns for MT prompts: 8 tokens over 1.0 s; one turn for qa: 4 tokens over 0.5 s; mean over prompts
    assert m["tokens_per_s"] == pytest.approx(8.0)
    assert m["speedup_vs_ar"] == pytest.approx(2.0) and m["speedup_vs_hf"] == pytest.approx(4.0)
    assert m["round_ms"] == {"backbone": 1.0, "head": 2.0, "gather": 0.0, "verify": 3.0}  # each call: 2 rounds
    assert m["tau"] == 2.0 and m["new_tokens"] == 20
    # decode-only: per turn 3 tokens after the prefill's first over 0.49 s
    assert m["decode_tokens_per_s"] == pytest.approx(statistics.mean([6 / 0.98, 6 / 0.98, 3 / 0.49]))
    assert json.loads(json.dumps(out, allow_nan=True))  # serialisable


def test_repeats_interleave_the_methods_and_keep_each_prompts_median_pass():
    """Every pass runs each method once per prompt, the methods in turn; a method's run of a prompt is its median
    pass by wall time, not the first or the fastest."""
    order = []

    class Timed(Scripted):
        def __init__(self, name, walls):
            super().__init__([5, 6], 0.0, [1])
            self.name, self.walls = name, iter(walls)

        def __call__(self, ids, max_new, sampling):
            order.append(self.name)
            self.wall = next(self.walls)
            return super().__call__(ids, max_new, sampling)

    prompts = [{"id": 1, "category": "qa", "turns": ["a?"]}, {"id": 2, "category": "qa", "turns": ["bb?"]}]
    runners = {"ar": Timed("ar", [3.0, 1.0, 2.0, 0.5, 0.7, 0.6]), "eagle": Timed("eagle", [1.0, 5.0, 4.0] * 2)}
    results = bench_loop(runners, prompts, encode, decode, 8, SamplingConfig(), progress=False, warmup=0, repeats=3)
    assert order == ["ar", "eagle"] * 6
    assert [r.wall_s for r in results["runs"]["ar"]] == [2.0, 0.6]
    assert [r.wall_s for r in results["runs"]["eagle"]] == [4.0, 4.0]
    with pytest.raises(ValueError, match="at least 1"):
        bench_loop(runners, prompts, encode, decode, 8, SamplingConfig(), progress=False, warmup=0, repeats=0)


def test_mt_prompts_run_both_turns_with_the_models_own_answer():
    runner = Scripted([11, 12], 1.0, [1])
    run = run_prompt(runner, PROMPTS[0], encode, decode, 8, SamplingConfig())
    assert runner.calls == 2
    first, second = runner.seen
    assert first == encode([{"role": "user", "content": "Write a poem."}])
    assert second == encode(
        [
            {"role": "user", "content": "Write a poem."},
            {"role": "assistant", "content": decode([11, 12])},
            {"role": "user", "content": "Now shorter."},
        ]
    )
    assert run.tokens == [11, 12, 11, 12] and run.wall_s == 2.0 and run.accept_lengths == [1, 1]
    assert run.turns == 2 and run.prefill_s == pytest.approx(0.02)


def test_mt_categories_are_merged_into_the_mt_group():
    _, out = fake_run()
    pc = out["methods"]["ar"]["per_category"]
    assert set(pc) == {"writing", "roleplay", "qa", "MT"}
    assert pc["MT"]["prompts"] == 2 and pc["qa"]["prompts"] == 1
    assert pc["MT"]["tokens_per_s"] == pytest.approx(4.0)  # 8 tokens / 2 s per MT prompt
    assert out["methods"]["eagle"]["per_category"]["MT"]["speedup_vs_ar"] == pytest.approx(2.0)
    ev = out["methods"]["nanospec"]["per_category"]["MT"]["evolution"]
    assert ev["active"][:2] == [100.0, 120.0] and ev["n"][0] == 2


def test_speedup_model_arithmetic():
    assert speedup_model(0.5, 0.1, 0.9) == pytest.approx(0.9 * 1.5 / 1.05)
    assert speedup_model(0.3, 1.0, 1.0) == pytest.approx(1.0)
    _, out = fake_run()
    sm = out["speedup_model"]
    # a round's share of decode time: eagle (0.5 - 0.01) s over 2 rounds per call, nanospec (0.4 - 0.01) s
    assert out["methods"]["eagle"]["decode_round_ms"] == pytest.approx(245.0)
    kappa = 2.0 / 243.0  # head 2 ms per round over the rest of the round
    assert sm["kappa"]["eagle"] == pytest.approx(kappa)
    v = sm["methods"]["nanospec"]  # head + gather 0.5 ms per round -> nu 0.25; same tau
    assert v["nu"] == pytest.approx(0.25) and v["rho_tau"] == pytest.approx(1.0)
    assert v["predicted"] == pytest.approx((1 + kappa) / (1 + 0.25 * kappa))
    assert v["measured"] == pytest.approx(245.0 / 195.0) and v["rest_ratio"] == pytest.approx(194.5 / 243.0)
    assert "eagle" not in sm["methods"]


def test_committed_past_is_the_chance_of_getting_past_each_depth():
    # rounds committing 1, 2, 4 and 3 tokens: past 1 in 3 of 4, past 2 in 2, past 3 in 1, past 4 in none
    assert committed_past([1, 2, 4, 3], depth=4) == [0.75, 0.5, 0.25, 0.0]
    assert committed_past([]) == []
    _, out = fake_run()
    assert len(out["methods"]["eagle"]["committed_past"]) == 5


def test_speedup_model_uses_the_matching_full_head():
    summary = {
        "eagle3": {"round_ms": {"backbone": 1, "head": 2, "verify": 3}, "tau": 2.0, "rounds": 5,
                   "decode_round_ms": 6.0, "decode_tokens_per_s": 10.0, "tokens_per_s": 9.0},
        "lowrank": {"round_ms": {"backbone": 1, "head": 1, "verify": 3}, "tau": 1.8, "rounds": 5,
                    "decode_round_ms": 5.0, "decode_tokens_per_s": 11.0, "tokens_per_s": 10.0},
    }  # fmt: skip
    specs = [MethodSpec.parse("eagle3", TREE), MethodSpec.parse("lowrank", TREE)]
    sm = add_speedup_model(summary, specs)
    v = sm["methods"]["lowrank"]
    assert v["reference"] == "eagle3" and sm["kappa"]["eagle3"] == pytest.approx(0.5)
    assert v["nu"] == pytest.approx(0.5) and v["rho_tau"] == pytest.approx(0.9)
    # the rest of the round did not move, so prediction and measurement agree exactly
    assert v["predicted"] == pytest.approx(0.9 * 1.5 / 1.25) and v["measured"] == pytest.approx(1.08)
    assert v["error"] == pytest.approx(0.0) and v["measured_mean"] == pytest.approx(1.1)
    # without a full-head run on its own tree the model does not apply; with one, that run is the reference
    other = MethodSpec.parse("lowrank@2x1x4+lookup:8", TREE)
    summary[other.name] = summary["lowrank"]
    assert other.name not in add_speedup_model(summary, [*specs, other])["methods"]
    ref = MethodSpec.parse("eagle3@2x1x4+lookup:8", TREE)
    summary[ref.name] = summary["eagle3"]
    sm = add_speedup_model(summary, [*specs, other, ref])
    assert sm["methods"][other.name]["reference"] == ref.name and sm["kappa"][ref.name] == pytest.approx(0.5)


def test_projection_counts_every_head_call_and_keeps_to_the_runs_tree():
    heads_json = Path(__file__).parents[1] / "benchmarks/runs/heads-llama3.1-8b/llama3.1-8b_bf16_t2.json"
    ms = json.loads(heads_json.read_text())["shapes"]["llama3.1-8b"]["heads"]["full"]["batches"]
    tree = TreeConfig(2, 4, 8, lookup=8)
    row = {"tau": 2.0, "rounds": 5, "decode_round_ms": 6.0}
    specs = [MethodSpec.parse(m, tree) for m in ("eagle", "nanospec", "nanospec@2x1x4")]
    out = project({s.name: row for s in specs}, specs, tree, heads_json)
    # draft_tree asks the head once at the root (1 row) and once per level (top_k rows)
    two = ms["1"]["ms"] + (ms["10"]["ms"] - ms["1"]["ms"]) * (2 - 1) / (10 - 1)
    assert out["round_ms"]["full_head"] == pytest.approx(ms["1"]["ms"] + 4 * two)
    assert set(out["methods"]) == {"eagle", "nanospec"}  # nanospec@2x1x4 has another round: left out


def test_report_files_from_a_small_result(tmp_path):
    _, out = fake_run()
    path = write_report(out, tmp_path)
    text = path.read_text()
    assert "| nanospec |" in text and "Speedup model" in text and "| MT |" in text
    # NanoSpec's active size / coverage per category (qa's only prompt reports 120 ids, coverage 0.75)
    vocab = text.split("## Active vocabulary per category")[1].split("##")[0]
    assert "| nanospec |" in vocab and "120 / 0.750" in vocab and "| eagle |" not in vocab
    for png in ("speed_tau.png", "nu_rho.png", "vocab_evolution.png", "latency.png"):
        assert (tmp_path / png).is_file() and 0 < (tmp_path / png).stat().st_size < 200_000
        assert f"]({png})" in text
    assert not (tmp_path / "wmax_sweep.png").exists()  # no nanospec sweep in this run


def test_wmax_sweep_plot_and_option_parsing(tmp_path):
    assert nanospec_w_max("nanospec") == 0
    assert nanospec_w_max("nanospec:1024") == 1024
    assert nanospec_w_max("nanospec:1024@4,4,16") is None  # another tree would confound the sweep
    assert nanospec_w_max("nanospec:1024:policy=lru") is None and nanospec_w_max("fr:8192") is None
    _, out = fake_run()
    base = out["methods"]["nanospec"]
    for name, tau in (("nanospec:512", 1.5), ("nanospec:1024", 1.8)):
        out["methods"][name] = {**base, "tau": tau}
    write_report(out, tmp_path)
    assert (tmp_path / "wmax_sweep.png").is_file()


def test_ctrl_c_keeps_finished_prompts_and_writes_partial_results(tmp_path):
    runners, out = fake_run(interrupt_at=3)  # eagle's third call: the second prompt's first turn... of 2+2+1
    assert out["config"]["interrupted"] is True
    assert out["config"]["prompts"] == 1 and [p["id"] for p in out["prompts"]] == [1]
    assert all(m["prompts"] == 1 for m in out["methods"].values())
    assert runners["nanospec"].calls == 2  # nanospec never started the interrupted prompt
    write_outputs(out, str(tmp_path / "b.json"), str(tmp_path / "rep"))
    saved = json.loads((tmp_path / "b.json").read_text(), parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert saved["config"]["interrupted"] is True and FIRST_KEYS <= set(saved["methods"]["eagle"])
    assert "Interrupted" in (tmp_path / "rep" / "report.md").read_text()


def test_method_parsing_and_presets():
    assert MethodSpec.parse("hf-pld:4", TREE).pld == 4 and MethodSpec.parse("hf-pld", TREE).kind == "pld"
    s = MethodSpec.parse("nanospec:1024@chain:3", TREE)
    assert (s.kind, s.head, s.tree.total_tokens) == ("spec", "nanospec:1024", 4)
    specs = [MethodSpec.parse(m, TREE) for m in ("eagle", "eagle3", "eagle@2x1x4", "lowrank", "nanospec@2x1x4")]
    assert specs[3].reference(specs).name == "eagle3"  # the low-rank drafter is EAGLE-3's twin
    assert specs[4].reference(specs).name == "eagle@2x1x4"  # the full head on the same tree
    assert s.reference(specs) is None  # no full-head run on its tree
    with pytest.raises(SpecheadError):
        MethodSpec.parse("hf-pld:x", TREE)
    ms = expand_methods("ar,main,eagle")
    assert ms[0] == "ar" and ms.count("eagle") == 1 and {"hf-pld", "nanospec", "hybrid", "lowrank"} <= set(ms)


def test_spec_bench_suite_selection():
    ev = default_eval_dir()
    mt = load_suite("spec-bench", limit=1, categories=["MT"], eval_dir=ev)
    assert [p["category"] for p in mt] == list(MT_BENCH) and all(len(p["turns"]) == 2 for p in mt)
    both = load_suite("spec-bench,humaneval", limit=2, categories=["qa", "code"], eval_dir=ev)
    assert [p["category"] for p in both] == ["qa", "qa", "code", "code"]
    mixed = load_suite("spec-bench", limit=3, categories=["writing", "stem", "rag"], limit_mt=1, eval_dir=ev)
    assert [p["category"] for p in mixed] == ["writing", "stem", "rag", "rag", "rag"]
    own = load_suite("spec-bench,humaneval:3", limit=1, categories=["qa", "code"], eval_dir=ev)  # a suite's own cap
    assert [p["category"] for p in own] == ["qa", "code", "code", "code"]


def test_demo_bench_is_lossless_over_two_turns(demo_session):
    from spechead.bench.harness import run_bench

    prompts = [{"id": 81, "category": "writing", "turns": ["Say hello.", "Again, in French."]}]
    out = run_bench(
        demo_session, prompts, ["ar", "nanospec"], "random", 4, progress=False, warmup=0,
        drafters={"eagle3": "random", "lowrank": "random"},
    )  # fmt: skip
    for name in ("nanospec",):
        m = out["methods"][name]
        assert m["mismatches_vs_ar"] == 0 and m["new_tokens"] == out["methods"]["ar"]["new_tokens"]
        assert m["extra_bytes"] > 0 and "rss_added_mb" in m and set(m["round_ms"]) >= {"backbone", "head", "verify"}
    nano = out["methods"]["nanospec"]
    assert nano["head_stats"]["active_size"] > 0 and not math.isnan(nano["head_stats"]["coverage"])
    # both turns ran (up to 4 tokens each); the vocabulary evolution follows the first turn's rounds
    ev = nano["per_category"]["MT"]["evolution"]
    assert nano["per_prompt"][0]["new_tokens"] > 4 and 0 < len(ev["active"]) < nano["rounds"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--methods", "ar,nope"], "unknown method 'nope'"),
        (["bench", "--methods", "ar,ar"], "duplicate method"),
        (["bench", "--methods", "hf-pld:0"], "hf-pld:N"),
        (["bench", "--categories", "no-such-category"], "no prompts selected"),
        (["coverage", "--tokenizer", "/no/such/tokenizer.json"], "tokenizer not found"),
        (["coverage", "--tokenizer", "demo", "--sizes", "a,b"], "--sizes"),
        (["coverage", "--tokenizer", "demo", "--size", "100000"], "at most the vocabulary size 49152"),
        (["bench-heads", "--shape", "demo", "--rank", "576"], "--rank must be below the hidden size of demo (576)"),
    ],
)
def test_bad_input_is_one_line_before_any_model_loads(args, message, capsys):
    from spechead.cli.commands import main

    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spechead: error") and message in err[0], err


def test_lowrank_without_its_drafter_uses_the_eagle3_twin(tiny_target, monkeypatch):
    from types import SimpleNamespace

    import spechead.bench.runners as bench

    monkeypatch.setattr(bench, "shipped_drafter_path", lambda arch="eagle2", target=None: None)
    session, cache = SimpleNamespace(target=tiny_target), {}
    specs = {"eagle2": "random", "eagle3": "random", "lowrank": "demo"}
    low, where = bench.method_drafter(session, "lowrank", specs, cache)
    assert low is bench.method_drafter(session, "eagle3", specs, cache)[0] and "SVD" in where
    assert low.arch == "eagle3" and bench.method_drafter(session, "eagle2", specs, cache)[0].arch == "eagle2"


def test_seeded_sampled_bench_counts_mismatches_and_finds_none(demo_session):
    """Sampled with a seed, the engine's speculative text is AR's (draws per position), so the bench checks it as
    it checks greedy text; without a seed each run draws its own, and nothing is compared."""
    from spechead.bench.harness import run_bench

    prompts = [{"id": 81, "category": "writing", "turns": ["Say hello.", "Again, in French."]}]
    kw = dict(progress=False, warmup=0, drafters={"eagle3": "random", "lowrank": "random"}, guard=False)
    kw["tree"] = TreeConfig(2, 1, 4, lookup=8)  # a fixed tree and no guard: speculative rounds whatever the CPU
    out = run_bench(demo_session, prompts, ["ar", "eagle"], "demo", 12, SamplingConfig(0.9, seed=5), **kw)
    m = out["methods"]["eagle"]
    assert m["mismatches_vs_ar"] == 0 and m["new_tokens"] == out["methods"]["ar"]["new_tokens"] and m["tau"] > 1
    unseeded = run_bench(demo_session, prompts, ["ar", "eagle"], "demo", 4, SamplingConfig(0.9), **kw)
    assert "mismatches_vs_ar" not in unseeded["methods"]["eagle"]
