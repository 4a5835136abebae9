"""``spechead bench-heads``: the report's structure and arithmetic (never its timings)."""

import json
import math

import pytest
import torch

from spechead import kernels
from spechead.bench.head_costs import (
    AMD_VNNI_MACS_PER_CYCLE,
    INT_MACS_PER_CYCLE,
    BenchSettings,
    bench_cases,
    bench_key,
    call_bytes,
    call_flops,
)
from spechead.bench.heads import SHAPES
from spechead.cli.commands import main
from spechead.heads import HEADS, make_head
from spechead.heads.base import check_head_spec
from spechead.tuning.measure import cpuinfo_field


def test_bench_heads_report(tmp_path):
    out = tmp_path / "heads.json"
    args = ["--shape", "demo", "--batch", "1,3", "--repeats", "1", "--hot", "--json", str(out)]
    small_rounds = ["--calls-per-round", "2", "--nodes", "6", "--new-per-round", "5", "--threads", "1"]
    assert main(["bench-heads", *args, *small_rounds]) == 0
    rep = json.loads(out.read_text())
    assert rep["config"]["threads"] == 1 and rep["machine"]["copy_GBps"] > 0
    res = rep["shapes"]["demo"]
    d, V = SHAPES["demo"]
    assert (res["d"], res["V"]) == (d, V)
    heads = res["heads"]
    expected = {"full", "fr:32768", "vocabtrim:32768", "lowrank:72", "nanospec:3072", "hybrid:3072"}
    assert expected - set(heads) <= set(res["skipped"])  # NanoSpec/hybrid only skipped with a reason
    for B in (1, 3):
        b = str(B)
        assert heads["full"]["batches"][b]["bytes"] == V * d * 2 + B * V * 2
        assert heads["full"]["batches"][b]["speedup_vs_full"] == 1.0
        assert heads["fr:32768"]["batches"][b]["bytes"] == 32768 * d * 2 + B * 32768 * 2
        assert heads["lowrank:72"]["batches"][b]["bytes"] == (72 * d + V * 72) * 2 + B * V * 2
        for h in heads.values():
            r = h["batches"][b]
            assert r["floor_ms"] == pytest.approx(r["bytes"] / res["copy_GBps"] / 1e6, rel=0.01, abs=2e-3)
            assert r["x_floor"] == pytest.approx(r["ms"] / r["floor_ms"], rel=0.02, abs=0.01)
    for name in ("nanospec:3072", "hybrid:3072"):
        if name in heads:
            # the steady state is real: every round gathered exactly the fresh ids the tree brought
            assert heads[name]["gathered_per_round"] == 5
            assert heads[name]["active_size"] == 3072
            assert set(heads[name]["batches"]["3"]["round_ms"]) == {"observe", "first_call", "other_calls"}


@pytest.mark.skipif(not kernels.available(), reason="the integer peak is a kernel path's")
def test_bench_heads_integer_floors(tmp_path):
    """--dtype q8: the kernel path in the JSON, and per row a bytes floor at the copy bandwidth, a compute floor at
    the path's peak, and finite positive ratios to both."""
    out = tmp_path / "q8.json"
    args = ["--shape", "demo", "--batch", "1", "--dtype", "q8", "--repeats", "1", "--hot", "--json", str(out)]
    small_rounds = ["--calls-per-round", "2", "--nodes", "6", "--new-per-round", "5", "--threads", "1"]
    assert main(["bench-heads", *args, *small_rounds]) == 0
    res = json.loads(out.read_text())["shapes"]["demo"]
    ik = res["int_kernel"]
    assert ik["path"] == kernels.ops().qlinear_path() and ik["threads"] == 1 and ik["clock_MHz"] > 0
    amd_vnni = ik["path"] == "avx512-vnni" and cpuinfo_field("vendor_id") == "AuthenticAMD"
    expected = AMD_VNNI_MACS_PER_CYCLE if amd_vnni else INT_MACS_PER_CYCLE[ik["path"]]["q8"]
    assert ik["macs_per_cycle_per_core"] == expected  # vpdpbusd at half the rate on AMD's 256-bit halves
    d, V = SHAPES["demo"]
    assert res["heads"]["full"]["batches"]["1"]["bytes"] == V * (d // 32) * (32 + 4) + V * 4  # blocks, scales, logits
    assert "lowrank" in res["skipped"]  # the demo's rank 72 is no multiple of the blocks' 32
    for name, h in res["heads"].items():
        r = h["batches"]["1"]
        assert r["path"] in INT_MACS_PER_CYCLE and r["macs"] * 2 == r["flops"]
        assert r["floor_ms"] == pytest.approx(r["bytes"] / res["copy_GBps"] / 1e6, rel=0.01, abs=2e-3)
        assert r["compute_floor_ms"] == pytest.approx(r["macs"] / r["peak_GMACs"] / 1e6, rel=0.01, abs=1e-4)
        for key in ("x_floor", "x_compute"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--shape", "gpt5"], "unknown shape 'gpt5'"),
        (["--batch", "0"], "--batch must be positive"),
        (["--batch", "a"], "--batch must be comma-separated integers"),
        (["--dtype", "int3"], "unknown dtype"),
        (["--nodes", "2", "--new-per-round", "7"], "cannot exceed --nodes"),
    ],
)
def test_bench_heads_bad_input(extra, match, capsys):
    assert main(["bench-heads", "--shape", "demo", *extra]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_has_bench_cases_that_run_and_count_their_bytes(name):
    """Every registered head has cases at a given shape; they run and move fewer bytes than the full head."""
    V, D = 49152, 32  # the demo's vocabulary, for which default token lists ship
    weight = torch.randn(V, D, generator=torch.Generator().manual_seed(0))
    settings = BenchSettings(subset=4096, w_max=512)
    cases = bench_cases(name, weight, V, settings, torch.Generator().manual_seed(2))
    assert cases
    full = make_head("full", weight, None, V)
    for case in cases:
        assert case.spec.partition(":")[0] == name and check_head_spec(case.spec)
        if case.head.per_round:
            case.head.begin(torch.arange(settings.w_max), None)
        for batch in (1, 3):
            logp, ids = case.head.topk(torch.randn(batch, D), 4)
            assert logp.shape == ids.shape == (batch, 4)
            nbytes, flops = call_bytes(case.head, batch, settings), call_flops(case.head, batch, settings)
            assert 0 < nbytes and 0 < flops
            assert (nbytes < call_bytes(full, batch, settings)) == (name != "full")  # every other head reads less
        assert bench_key(case.spec, [c.spec for c in cases]) == case.spec
