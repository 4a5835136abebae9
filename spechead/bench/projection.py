"""The benchmark's speedups projected to Llama-3.1-8B shapes (the paper's model): head times from a
``spechead bench-heads`` JSON, the rest of a round from a roofline on the same machine's figures, tau
ratios from the run (see docs/bench.md for the assumptions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spechead.bench.head_costs import bench_key
from spechead.bench.methods import MethodSpec
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.tuning.speedup import speedup_model

LLAMA31_8B = {"d": 4096, "V": 128256, "layers": 32, "ffn": 14336, "kv": 1024}


def _layer_params(c: dict[str, int]) -> int:
    d = c["d"]
    return 2 * d * d + 2 * d * c["kv"] + 3 * d * c["ffn"]


def _roofline_ms(params: int, tokens: int, bytes_per: int, gbps: float, gflops: dict[str, float]) -> float:
    """A forward of `tokens` tokens through `params` weights: the slower of reading them and multiplying."""
    rates = {int(k): v for k, v in gflops.items()}
    rate = rates[min(rates, key=lambda b: abs(b - tokens))]
    return max(params * bytes_per / gbps / 1e6, 2 * params * tokens / rate / 1e6)


def _headbench_ms(heads: dict[str, Any], key: str, batch: int) -> float | None:
    h = heads.get(key)
    if h is None:
        return None
    b = {int(k): v["ms"] for k, v in h["batches"].items()}
    if batch in b:
        return b[batch]
    lo = max((x for x in b if x < batch), default=None)
    hi = min((x for x in b if x > batch), default=None)
    if lo is None or hi is None:
        return b[min(b, key=lambda x: abs(x - batch))]
    return b[lo] + (b[hi] - b[lo]) * (batch - lo) / (hi - lo)  # linear in the batch between measured ones


def project(summary: dict[str, Any], specs: list[MethodSpec], tree: TreeConfig, heads_json: Path) -> dict[str, Any]:
    """Speedups at Llama-3.1-8B shapes on the machine the head benchmark ran on.

    Assumptions (docs/bench.md): head ms per call are the head benchmark's (cold cache, its dtype and
    threads); a round is one root call at batch 1 plus depth calls at batch top_k; the rest of a
    round is a roofline estimate from the same file's copy bandwidth and GEMM rates: the target
    verifying ``max_rows`` tokens (the tree with a full lookup branch, the upper bound) through its
    non-embedding weights + LM head, and the drafter's decoder layer (+ fc) running depth + 1 times;
    tau ratios (rho_tau) and tau are the ones measured here on the demo model, which assumes
    acceptance transfers to the larger vocabulary."""
    data = json.loads(heads_json.read_text())
    shape = data["shapes"].get("llama3.1-8b")
    if shape is None:
        raise SpecheadError(f"{heads_json} has no llama3.1-8b shape")
    heads, gbps, rates = shape["heads"], shape["copy_GBps"], shape["gemm_GFLOPs_in_cache"]
    e = {"bf16": 2, "fp16": 2, "fp32": 4}[shape["dtype"]]
    c = LLAMA31_8B
    target_params = c["layers"] * _layer_params(c) + c["V"] * c["d"]
    drafter_params = _layer_params(c) + 2 * c["d"] * c["d"]
    verify = _roofline_ms(target_params, tree.max_rows, e, gbps, rates)
    ar_ms = _roofline_ms(target_params, 1, e, gbps, rates)
    backbone = (tree.depth + 1) * _roofline_ms(drafter_params, 1, e, gbps, rates)

    def head_round(key: str) -> float | None:
        one, many = _headbench_ms(heads, key, 1), _headbench_ms(heads, key, tree.top_k)
        return None if one is None or many is None else one + tree.depth * many  # draft_tree's calls

    full = head_round("full")
    rest = verify + backbone
    out: dict[str, Any] = {
        "source": str(heads_json),
        "machine": data.get("config", {}).get("cpu"),
        "threads": data.get("config", {}).get("threads"),
        "dtype": shape["dtype"],
        "round_ms": {"verify": verify, "backbone": backbone, "full_head": full, "ar_token": ar_ms},
        "kappa": full / rest if full else float("nan"),
        "methods": {},
    }
    for s in specs:
        ref_spec = s.reference(specs) if s.kind == "spec" and s.tree == tree else None
        if ref_spec is None:
            continue  # the projection's round is the run's tree
        key = bench_key(s.head, list(heads))
        h = head_round(key) if key else None
        ref = summary.get(ref_spec.name)
        if h is None or full is None or ref is None:
            continue
        m = summary[s.name]
        nu, rho = h / full, m["tau"] / ref["tau"]
        out["methods"][s.name] = {
            "headbench": key,
            "head_ms_per_round": h,
            "nu": nu,
            "rho_tau": rho,
            "speedup_vs_full_head": speedup_model(out["kappa"], nu, rho),
            "speedup_vs_ar": m["tau"] * ar_ms / (rest + h),
        }
    return out
