"""The command line on bad input: one clear line on stderr, non-zero exit, no traceback."""

import json
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "spechead.cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.once  # refused before any decoding
@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", ""], "empty prompt"),
        (["generate", "--prompt", "hi", "--head", "nope"], "unknown head"),
        (["generate", "--prompt", "hi", "--head", "full:3"], "takes no argument"),
        (["generate", "--prompt", "hi", "--method", "nope"], "unknown method"),
        (["generate", "--prompt", "hi", "--drafter", "/no/such/dir"], "drafter not found"),
        (["generate", "--prompt", "hi", "--target", "/no/such/model"], "target not found"),
        (["generate", "--prompt", "hello " * 300, "--max-len", "256"], "does not fit the context"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["bench", "--suite", "/no/such.jsonl"], "suite file not found"),
        # the server refuses its options before it loads the (here missing) target
        (["serve", "--max-batch", "0", "--target", "/no/such/model"], "--max-batch must be in [1, 64], got 0"),
        (["serve", "--max-batch", "65", "--target", "/no/such/model"], "--max-batch must be in [1, 64], got 65"),
        (["serve", "--queue-size", "-1", "--target", "/no/such/model"], "--queue-size >= 0"),
        (["serve", "--max-tokens", "0", "--target", "/no/such/model"], "--max-tokens >= 1"),
        (["serve", "--head", "nope", "--target", "/no/such/model"], "unknown head"),
        (["serve", "--drafter", "/no/such/dir", "--target", "/no/such/model"], "drafter not found"),
        # so do training (a --save-every of 0 used to fail at the first save, after the steps) and the batch study
        (["train-drafter", "--out", "/no/such/run", "--target", "/no/such/model", "--save-every", "0"], "--save-every"),
        (["train-drafter", "--out", "/no/such/run", "--target", "/no/such/model", "--lr", "-1"], "--lr must be > 0"),
        (["train-drafter", "--out", "/no/such/run", "--target", "/no/such/model", "--epochs", "0"], "--epochs"),
        (["bench", "--batch", "1,2", "--repeats", "0", "--target", "/no/such/model"], "--repeats must be >= 1"),
    ],
)
def test_bad_input_is_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("spechead: error")]
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.once  # refused by argparse
@pytest.mark.parametrize("threads", ["0", "-2"])
def test_threads_must_be_positive(threads):
    r = run("generate", "--prompt", "hi", "--threads", threads, "--target", "/no/such/model")
    assert r.returncode == 2 and "--threads: expected a positive integer" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.once  # refused at load
def test_corrupt_drafter_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    r = run("generate", "--prompt", "hi", "--drafter", str(tmp_path))
    assert r.returncode == 2 and "corrupt" in r.stderr and "Traceback" not in r.stderr


def test_generate_json_matches_ar(tmp_path):
    """The CLI's speculative output equals its AR output (greedy) on the demo model."""
    outs = {}
    for method in ("ar", "eagle"):
        r = run(
            "generate",
            "--prompt",
            "List three colors.",
            "--method",
            method,
            "--max-new-tokens",
            "24",
            "--drafter",
            "random",
            "--json",
        )
        assert r.returncode == 0, r.stderr
        outs[method] = json.loads(r.stdout)
        if method == "eagle":  # --tree auto went to the tuner (off in tests: conftest), not the no-tuner default
            assert "tuning disabled by SPECHEAD_TUNE" in r.stderr and "no tuner attached" not in r.stderr
    assert outs["ar"]["tokens"] == outs["eagle"]["tokens"]
    assert outs["eagle"]["new_tokens"] == len(outs["eagle"]["tokens"]) > 0


def test_bench_json_keys(tmp_path):
    suite = tmp_path / "s.jsonl"
    suite.write_text(json.dumps({"category": "qa", "turns": ["What is the capital of France?"]}) + "\n")
    out = tmp_path / "b.json"
    r = run(
        "bench",
        "--suite",
        str(suite),
        "--methods",
        "ar,eagle",
        "--drafter",
        "random",
        "--max-new-tokens",
        "16",
        "--json",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["methods"]
    for m in ("ar", "eagle"):
        assert {"tokens_per_s", "tau", "speedup_vs_ar", "mismatches_vs_ar"} <= set(res[m])
    assert res["eagle"]["mismatches_vs_ar"] == 0
