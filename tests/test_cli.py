"""The command line on bad input: one clear line on stderr, non-zero exit, no traceback."""

import json
import os
import subprocess
import sys

import pytest


def run(*args, timeout=300, env=None):
    env = None if env is None else {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-m", "spechead.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


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
        (["bench", "--suite", "/no/such.jsonl"], "suite file not found"),
        # the server refuses its options before it loads the (here missing) target
        (["serve", "--max-batch", "0", "--target", "/no/such/model"], "--max-batch must be in [1, 64], got 0"),
        (["serve", "--max-batch", "65", "--target", "/no/such/model"], "--max-batch must be in [1, 64], got 65"),
        (["serve", "--queue-size", "-1", "--target", "/no/such/model"], "--queue-size >= 0"),
        (["serve", "--max-tokens", "0", "--target", "/no/such/model"], "--max-tokens >= 1"),
        (["serve", "--head", "nope", "--target", "/no/such/model"], "unknown head"),
        (["serve", "--drafter", "/no/such/dir", "--target", "/no/such/model"], "drafter not found"),
        # so does training (a --save-every of 0 used to fail at the first save, after the steps)
        (["train-drafter", "--out", "/no/such/run", "--target", "/no/such/model", "--save-every", "0"], "--save-every"),
        (["train-drafter", "--out", "/no/such/run", "--target", "/no/such/model", "--lr", "-1"], "--lr must be > 0"),
        (["train-drafter", "--out", "/no/such/run", "--target", "/no/such/model", "--epochs", "0"], "--epochs"),
        (["generate", "--prompt", "hi", "--tree", "chain:100000"], "at most 1024 tokens"),  # drafted for minutes
        (["generate", "--prompt", "hi", "--tree", "chain:0"], "a chain drafts at least 1 token"),
        (["generate", "--prompt", "hi", "--head", "nanospec:3072:q3"], "bad head option 'q3'"),
        # a head's options in --methods were checked after loading, and a bad one skipped with exit 0
        (["bench", "--methods", "ar,nanospec:abc", "--target", "/no/such/model"], "method 'nanospec:abc'"),
        (["gen-data", "--data", "x.jsonl", "--out", "/no/such/o.jsonl", "--temperature", "-1"], "--temperature"),
        (["tune", "--head", "bogus", "--target", "/no/such/model"], "unknown head"),
        (["export", "--out", "/no/such/out", "--head", "bogus", "--target", "/no/such/model"], "unknown head"),
        (["extract", "--features", "/no/such/f", "--data", "x.jsonl", "--pack-tokens", "10"], "at least --max-len"),
    ],
)
def test_bad_input_is_one_line(args, message):
    r = run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("spechead: error")]
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt", "hi", "--threads", "0"], "--threads: expected a positive integer"),
        (["generate", "--prompt", "hi", "--dtype", "int3"], "--dtype: unknown dtype 'int3'"),
        (["generate", "--prompt", "hi", "--threads", "-2"], "--threads: expected a positive integer"),
        (["generate", "--prompt", "hi", "--max-len", "-5"], "--max-len: expected a positive integer"),
        # sampling and lengths: spechead.options' checks, as the API and the server make them
        (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature: temperature must be in [0, 2]"),
        (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
        (["generate", "--prompt", "hi", "--top-k", "-2"], "--top-k: top_k must be >= 0"),
        (["generate", "--prompt", "hi", "--seed", "x"], "--seed: expected an integer"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: max_new_tokens must be >= 1"),
        (["bench", "--temperature", "3"], "--temperature: temperature must be in [0, 2]"),
        (["serve", "--port", "99999"], "--port: expected a port in [0, 65535]"),
        (["extract", "--features", "/no/such/f", "--data", "x.jsonl", "--chunk-tokens", "0"], "--chunk-tokens"),
        (["bench-heads", "--shape", "demo", "--k", "0"], "--k: expected a positive integer"),
        (["train-drafter", "--out", "/no/such/run", "--stop-after", "-1"], "--stop-after: expected a positive"),
        (["bench", "--warmup", "-1"], "--warmup: expected an integer >= 0"),
        (["bench", "--limit-mt", "-1"], "--limit-mt: expected a positive integer"),
        (["bench", "--batch", "1,2", "--repeats", "0"], "--repeats: expected a positive integer"),
        (["bench-heads", "--subset", "0"], "--subset: expected a positive integer"),
    ],
)
def test_out_of_range_options_are_usage_errors(args, message):
    r = run(*args, "--target", "/no/such/model") if args[0] != "bench-heads" else run(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_serve_refuses_a_taken_port_before_loading():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("serve", "--port", str(port), "--target", "/no/such/model")
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr


def test_training_never_writes_over_a_drafter(tmp_path):
    """--out holding a drafter but no run to resume (a shipped drafter's folder, say) is refused before loading."""
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    r = run("train-drafter", "--out", str(tmp_path), "--features", str(tmp_path), "--target", "/no/such/model")
    assert r.returncode == 2 and "already holds a drafter" in r.stderr, r.stderr
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"


def test_data_spec_counts_are_positive(tmp_path):
    from spechead.errors import SpecheadError
    from spechead.training.data import parse_data_spec

    f = tmp_path / "chat.jsonl"
    f.write_text("")
    assert parse_data_spec(f"{f}:3") == (f, 3) and parse_data_spec(str(f)) == (f, None)
    for bad in ("0", "-1", "abc"):  # was: 0 read as a count, the others as "file not found"
        with pytest.raises(SpecheadError, match="positive integer"):
            parse_data_spec(f"{f}:{bad}")


def test_export_never_writes_over_a_folder(tmp_path):
    """--out naming the drafter being read (or any non-empty folder, or a file) is refused before loading."""
    (tmp_path / "config.json").write_text("{}")
    for out in (tmp_path, tmp_path / "config.json"):
        r = run("export", "--drafter", str(tmp_path), "--out", str(out), "--target", "/no/such/model")
        assert r.returncode == 2 and "already exists" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert (tmp_path / "config.json").read_text() == "{}"


def test_a_truncated_gguf_target_is_one_error_line(tmp_path, monkeypatch):
    """A GGUF cut short is refused when it is read: one line, exit code 2, nothing left in the cache."""
    from spechead.model.loading import PACKAGED_TARGETS

    demo = PACKAGED_TARGETS["demo"].gguf_path(tmp_path)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(demo.read_bytes()[: 4 << 20])
    cache = tmp_path / "cache"
    r = run("generate", "--prompt", "hi", "--method", "ar", "--target", str(bad), env={"SPECHEAD_CACHE": str(cache)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cut.gguf" in [ln for ln in r.stderr.splitlines() if ln.startswith("spechead: error")][0]
    assert not any(p.name.startswith("cut") for p in cache.iterdir())


def test_gguf_needs_a_gguf_target(tiny_dir):
    r = run("generate", "--prompt", "hi", "--method", "ar", "--target", str(tiny_dir), "--dtype", "gguf")
    assert r.returncode == 2 and "runs a GGUF file's own weights" in r.stderr and "Traceback" not in r.stderr


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
