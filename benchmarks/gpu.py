"""The GPU study: spechead's draft heads, an 8B-shaped round and the real targets on one device, in one run.

1. Heads at Llama-3.1-8B's shape (d 4096, V 128,256) and Gemma 3's (d 640, V 262,144): full, fr:32768,
   vocabtrim:32768, nanospec:3072 (its per-round set update and gather included), lowrank (rank d/8: 512 and 80)
   and hybrid where its list exists, at 1-64 rows a call, timed by ``spechead bench-heads``'s code
   (``spechead.bench.heads.bench_shape``: cold L2, heads interleaved, medians), each beside its bytes floor at the
   read bandwidth measured here.
2. A Llama-3.1-8B-shaped target (32 layers, 32 / 8 heads, FFN 14,336, V 128,256) and an EAGLE-3-shaped drafter with
   random weights, generated on the device: the AR decode step, verification at 1-64 rows, drafter passes, and each
   head's round in the engine (``Decoder``, no guard) on three trees; the speedup model (``spechead.tuning.predict``)
   for each head at the acceptance the shipped drafters measured in the kept runs of ``benchmarks/runs/`` (each
   scenario names its file), beside the measured round; and a draft step split as NanoSpec's Table 4 (drafter
   backbone, gather, head) beside the paper's figures.
3. The demo target (SmolLM2-135M) and Gemma 3 270M end to end: greedy, AR and every head on the shipped EAGLE-2
   drafter, each speculative output compared token for token with the device's own AR output. A target that is not
   installed where the script runs is listed as skipped with the reason; ``--demo-target`` / ``--gemma-target``
   take a folder or a ``.gguf`` file staged there instead.

Every step runs under a time budget (what it left out is listed in the JSON), and the JSON and the Markdown are
written after every shape, tree and target, so a run cut short keeps what it measured; a step that fails is
recorded with its traceback and the next one runs.

    python benchmarks/gpu.py --device cuda --out runs/gpu                      (one GPU, under 8 minutes)
    .venv/bin/python benchmarks/gpu.py --device cpu --small --out runs/gpu-cpu   (the CPU rehearsal, about a minute)

Writes OUT/gpu.json and OUT/gpu.md (the tables, also printed). bf16 on the device (step 3 also in fp32, the
precision of the CPU figures); --small shrinks every shape, runs in fp32, and decodes 8 tokens of one prompt.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's spechead, installed or not

from spechead.bench.head_costs import BenchSettings, bench_cases, bench_key  # noqa: E402
from spechead.bench.heads import DTYPES, Flusher, bench_shape, copy_meter, synchronize  # noqa: E402
from spechead.decoding.decoder import Decoder  # noqa: E402
from spechead.decoding.session import Session, resolve_drafter  # noqa: E402
from spechead.decoding.tree import TreeConfig  # noqa: E402
from spechead.errors import SpecheadError  # noqa: E402
from spechead.heads.base import DraftHead, make_head  # noqa: E402
from spechead.model.config import ModelConfig  # noqa: E402
from spechead.model.drafter import Drafter, build_drafter, draft_config_from_target  # noqa: E402
from spechead.model.loading import load_target  # noqa: E402
from spechead.model.tokenizer import load_tokenizer  # noqa: E402
from spechead.model.transformer import Transformer  # noqa: E402
from spechead.tuning.predict import predict  # noqa: E402
from spechead.tuning.speedup import speedup_model  # noqa: E402

HEAD_ROWS = (1, 2, 4, 8, 10, 16, 32, 64)  # rows a draft call scores (10: EAGLE-2's top_k)
STUDY_HEADS = ("full", "fr", "vocabtrim", "nanospec", "lowrank")
E2E_HEADS = ("full", "fr", "vocabtrim", "nanospec", "lowrank", "hybrid")
PAPER_TREE = "10x5x60"  # EAGLE-2's tree for Llama-3.1-8B (top_k 10, depth 5, 60 tokens): NanoSpec's setting
PROMPTS = (
    "Why is the sky blue? Answer in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List the planets of the solar system in order from the sun, one per line.",
    "Summarize in one sentence: The committee met on Monday, reviewed the budget, cut travel spending by a "
    "third and moved the saved money to the student scholarship fund.",
)
# NanoSpec's Table 4: one draft step of EAGLE-2 on Llama-3.1-8B-Instruct, ms (../shared/seeds, the NanoSpec paper)
PAPER_TABLE4 = {
    "full": {"backbone": 1.405, "gather": None, "head": 2.330, "total": 3.735},
    "fr": {"backbone": 1.401, "gather": None, "head": 0.771, "total": 2.172},
    "nanospec": {"backbone": 1.403, "gather": 0.003, "head": 0.237, "total": 1.640},
}
# The acceptance behind the speedup model: kept runs whose heads share one drafter and tree (tau per head).
TAU_SOURCES = {
    "demo": {
        "file": "benchmarks/runs/headline-zen4/bench_avx512.json",
        "tree": "2x2x5+lookup:8",
        "methods": {"full": "eagle@2x2x5+lookup:8", "nanospec": "nanospec", "lowrank": "lowrank"},
        "note": "SmolLM2-135M, shipped EAGLE-2 drafter (lowrank: the rank-72 EAGLE-3 drafter), 14 prompts x 96 tokens",
    },
    "gemma3-270m": {
        "file": "benchmarks/runs/gemma3-270m/bench.json",
        "tree": "2x1x4+lookup:8",
        "methods": {h: f"{'eagle' if h == 'full' else h}@2x1x4+lookup:8" for h in STUDY_HEADS},
        "note": "Gemma 3 270M, shipped EAGLE-2 drafter (lowrank: its fitted rank-80 head), 16 prompts x 96 tokens",
    },
}
LLAMA31_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


@dataclass
class Plan:
    """What one run measures: the device's sizes, or the CPU rehearsal's (``--small``)."""

    shapes: dict[str, tuple[int, int]]  # head study: name -> (d, V)
    settings: BenchSettings
    head_repeats: int
    cold: bool  # flush the last-level cache (a GPU's L2) before every head call
    model: dict[str, Any]  # the 8B-shaped target's config.json
    context: int  # tokens in the cache when the step, verification and drafter passes are timed
    repeats: int
    engine_new: int  # tokens each engine round measurement decodes
    prompts: int
    max_new: int
    budget_s: dict[str, float] = field(default_factory=dict)


def plan_of(small: bool) -> Plan:
    if not small:
        return Plan(
            shapes={"llama3.1-8b": (4096, 128256), "gemma3-270m": (640, 262144)},
            settings=BenchSettings(subset=32768, w_max=3072),
            head_repeats=25,
            cold=True,
            model=LLAMA31_8B,
            context=512,
            repeats=10,
            engine_new=32,
            prompts=len(PROMPTS),
            max_new=64,
            budget_s={"heads": 100, "model": 170, "e2e": 160},
        )
    small = LLAMA31_8B | {"vocab_size": 8192, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4}
    small |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    return Plan(
        shapes={"llama3.1-8b": (256, 8192), "gemma3-270m": (64, 16384)},
        settings=BenchSettings(subset=2048, w_max=384),
        head_repeats=3,
        cold=False,  # a CPU's flush reads twice its LLC (hundreds of MB) per call: minutes at 8 row counts
        model=small,
        context=64,
        repeats=3,
        engine_new=8,
        prompts=1,
        max_new=8,
        budget_s={"heads": 30, "model": 30, "e2e": 90},
    )


# -- timing and bookkeeping ------------------------------------------------------------------------
def median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` after one warm-up call, each call synchronised on the device."""
    fn()
    synchronize(device)
    ts = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


class Budget:
    """A step's time limit (``over`` once it is spent)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def over(self) -> bool:
        return time.perf_counter() > self.deadline


class Study:
    """The result being built: ``save`` writes the JSON and the Markdown as they stand."""

    def __init__(self, out: Path, data: dict[str, Any]) -> None:
        self.out, self.data = out, data
        out.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        (self.out / "gpu.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "gpu.md").write_text(markdown(self.data))


def log(msg: str) -> None:
    print(f"[gpu.py +{time.perf_counter() - T0:.0f}s] {msg}", file=sys.stderr, flush=True)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- 0. the machine --------------------------------------------------------------------------------
def machine(device: torch.device) -> dict[str, Any]:
    bw = copy_meter(device).start()
    out: dict[str, Any] = {"torch": torch.__version__, "read_GBps": round(bw["read_GBps"], 1)}
    out["copy_GBps"] = round(bw["copy_GBps"], 1)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        out |= {"device": p.name, "cuda": torch.version.cuda, "memory_GiB": round(p.total_memory / 2**30, 1)}
        out |= {"L2_MB": p.L2_cache_size / 2**20, "multiprocessors": p.multi_processor_count}
    else:
        from spechead.tuning.measure import cpu_name

        out |= {"device": f"cpu: {cpu_name()}", "threads": torch.get_num_threads()}
    return out


# -- 1. the heads ----------------------------------------------------------------------------------
def head_study(plan: Plan, device: torch.device, dtype_name: str, read_gbps: float, budget: Budget, out, save) -> None:
    """``bench_shape`` at each shape (its copy-bandwidth floors kept), plus each row's floor at the read bandwidth."""
    args = Namespace(seed=0, k=10, repeats=plan.head_repeats, **vars(plan.settings))
    flush, meter = Flusher(not plan.cold, device), copy_meter(device)
    meter.start()
    out |= {"rows": list(HEAD_ROWS), "dtype": dtype_name, "shapes": {}, "skipped": {}}
    for name, dims in plan.shapes.items():
        if budget.over():
            out["skipped"][name] = "time budget"
            continue
        log(f"heads at {name} {dims}")
        meter.samples.clear()
        res = bench_shape(name, list(HEAD_ROWS), dtype_name, args, flush, meter, device, dims, budget.deadline)
        for h in res["heads"].values():
            for r in h["batches"].values():
                floor = r["bytes"] / read_gbps / 1e6
                r["floor_read_ms"], r["x_floor_read"] = round(floor, 5), round(r["ms"] / floor, 2)
        out["shapes"][name] = res
        save()
        free(device)


def head_round_costs(heads: dict[str, Any], ks: list[int]) -> dict[str, dict]:
    """Per head name, per k: a round's root call (1 row; NanoSpec's set update included) and a level call (k rows),
    from the head study, in ``tuning.predict``'s cost format; ``gather``: the set update alone (NanoSpec)."""
    out: dict[str, dict] = {}
    for name in STUDY_HEADS:
        key = bench_key(name, list(heads))
        if key is None:
            continue
        b = heads[key]["batches"]
        if not all(str(k) in b for k in [1, *ks]):
            continue
        one = b["1"]
        root = one["round_ms"]["observe"] + one["round_ms"]["first_call"] if "round_ms" in one else one["ms"]
        level = {k: b[str(k)]["round_ms"]["other_calls"] if "round_ms" in b[str(k)] else b[str(k)]["ms"] for k in ks}
        gather = one["round_ms"]["observe"] if "round_ms" in one else None
        out[name] = {"key": key, "gather": gather} | {k: {"root": root, "level": level[k]} for k in ks}
    return out


# -- 2. the 8B-shaped model ------------------------------------------------------------------------
def random_init_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights ~ N(0, 0.02), norms 1, drawn where the module lives."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def random_models(cfg_dict: dict[str, Any], device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Drafter]:
    """The target and an EAGLE-3 drafter (full-vocabulary head) of that config, random, built on the device: laid
    out on the meta device, then allocated and drawn there (an 8B model never passes through host memory)."""
    gen = torch.Generator(device).manual_seed(0)
    with torch.device("meta"):
        target = Transformer(ModelConfig.from_hf(cfg_dict))
    target = target.to(dtype).to_empty(device=device)
    random_init_(target, gen)
    target = target.eval().requires_grad_(False).fuse()
    cfg = draft_config_from_target(target.config, draft_vocab_size=target.config.vocab_size)
    with torch.device("meta"):
        drafter = build_drafter("eagle3", cfg, target)
    drafter = drafter.to(dtype).to_empty(device=device)
    random_init_(drafter, gen)
    return target, drafter.eval().requires_grad_(False)


def chain_mask(n: int, cached: int, device: torch.device) -> Tensor:
    """n chain tokens after ``cached`` positions: each sees the cache and the tokens before it."""
    tril = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(n, cached, dtype=torch.bool, device=device), tril], dim=1)


@torch.inference_mode()
def model_parts(target: Transformer, drafter: Drafter, plan: Plan, device: torch.device, budget: Budget) -> dict:
    """AR step, verification of 1-64 chain tokens, and drafter passes (catch-up and tree level), median ms."""
    V, p = target.config.vocab_size, plan.context
    target.setup_cache(p + 128)
    drafter.setup_cache(p + 128)
    x = torch.randint(0, V, (p + 64,), generator=torch.Generator().manual_seed(1)).to(device)
    pre = target(x[:p], 0, want_aux=True)
    feats = drafter.target_features(pre)
    out: dict[str, Any] = {"context": p, "verify_ms": {}, "drafter_ms": {}, "drafter_tree_ms": {}, "skipped": []}
    out["ar_step_ms"] = median_ms(
        lambda: target(x[p - 1 : p], p, want_aux=True).logits.argmax(-1), plan.repeats, device
    )
    for n in sorted(set(range(1, 17)) | set(HEAD_ROWS)):
        if budget.over():
            out["skipped"].append(f"verify {n}")
            continue
        toks, mask, pos = x[p : p + n], chain_mask(n, p, device), torch.arange(p, p + n, device=device)
        fn = lambda toks=toks, mask=mask, pos=pos: target(toks, p, pos, mask, want_aux=True).logits.argmax(-1)  # noqa: E731
        out["verify_ms"][n] = median_ms(fn, plan.repeats, device)
    for n in range(1, 11):  # catch-up passes: the tokens a round committed
        toks, f, pos = x[p : p + n], feats[:n], torch.arange(p, p + n, device=device)
        out["drafter_ms"][n] = median_ms(lambda t=toks, f=f, pos=pos: drafter(t, f, p, pos, None), plan.repeats, device)
    h = drafter(x[p - 1 : p], feats[-1:], p, torch.tensor([p], device=device), None)
    for k in (1, 2, 4, 10):  # one tree level: k siblings after the catch-up state
        toks, hk = x[p : p + k], h.expand(k, -1).contiguous()
        siblings = torch.eye(k, dtype=torch.bool, device=device)
        mask = torch.cat([torch.ones(k, p + 1, dtype=torch.bool, device=device), siblings], dim=1)
        pos = torch.full((k,), p + 1, dtype=torch.long, device=device)
        fn = lambda t=toks, hk=hk, m=mask, pos=pos: drafter(t, hk, p + 1, pos, m)  # noqa: E731
        out["drafter_tree_ms"][k] = median_ms(fn, plan.repeats, device)
    return out


class RowCounter:
    """Rows the engine verifies (``forward_batch`` parts with a tree mask) and the drafter's catch-up passes (its
    calls without a mask, the prompt's first one left out), counted while it decodes."""

    def __init__(self, target: Transformer, drafter: Drafter) -> None:
        self.verify: list[int] = []
        self.backbone: list[int] = []
        self.target, inner = target, target.forward_batch

        def counted(parts, want_aux: bool = False):
            self.verify += [p.tokens.shape[0] for p in parts if p.mask is not None]
            return inner(parts, want_aux)

        target.forward_batch = counted  # an instance attribute over the method, removed by close()
        self.hook = drafter.register_forward_pre_hook(self._drafter)

    def _drafter(self, module, args) -> None:
        if len(args) > 4 and args[4] is None:
            self.backbone.append(int(args[0].shape[0]))

    def close(self) -> tuple[list[int], list[int]]:
        del self.target.forward_batch
        self.hook.remove()
        return self.verify, self.backbone[1:]


def engine_heads(target: Transformer, drafter: Drafter, settings: BenchSettings) -> dict[str, Callable[[], DraftHead]]:
    """Each study head over the drafter's head, as the head benchmark builds it (random ids for the static lists,
    random factors for the low-rank head, whose cost does not depend on them); NanoSpec as users run it."""
    w, ids = drafter.head_weight(target)
    V = target.config.vocab_size
    out: dict[str, Callable[[], DraftHead]] = {}
    for name in STUDY_HEADS:
        if name == "nanospec":
            out[name] = lambda: make_head(f"nanospec:{min(settings.w_max, V)}", w, ids, V)
        else:
            out[name] = lambda name=name: bench_cases(name, w, V, settings, torch.Generator().manual_seed(0))[0].head
    return out


@torch.inference_mode()
def engine_rounds(target, drafter, plan: Plan, trees: list[str], device: torch.device, budget: Budget) -> tuple:
    """Per tree and head: the engine's speculative rounds on a random prompt (no guard; random weights accept
    about nothing, so each round commits about one token): ms per round and its parts, and the rows verified;
    with the rows of every verification and catch-up pass, per (tree, head)."""
    V = target.config.vocab_size
    prompt = torch.randint(0, V, (plan.context,), generator=torch.Generator().manual_seed(2))
    max_len = plan.context + plan.engine_new + 128
    ar = Decoder(target, max_len=max_len)
    ar.generate(prompt[:16], 4)
    res = ar.generate(prompt, plan.engine_new)
    out: dict[str, Any] = {"ar_token_ms": 1e3 * (res.wall_s - res.prefill_s) / max(len(res.tokens) - 1, 1)}
    out["trees"], out["skipped"] = {}, []
    rows_seen: dict[tuple[str, str], tuple[list[int], list[int]]] = {}
    heads = engine_heads(target, drafter, plan.settings)
    for spec in trees:
        tree = TreeConfig.parse(spec)
        for name, make in heads.items():
            if budget.over():
                out["skipped"].append(f"{name} on {spec}")
                continue
            dec = Decoder(target, drafter, make(), tree, max_len)
            dec.generate(prompt[:16], 4)  # warm-up
            rows = RowCounter(target, drafter)
            res = dec.generate(prompt, plan.engine_new)
            verify_rows, backbone_rows = rows.close()
            rounds = max(len(res.accept_lengths), 1)
            parts = {k: res.timers_ms.get(k, 0.0) / rounds for k in ("backbone", "head", "gather", "verify")}
            out["trees"].setdefault(spec, {})[name] = {
                "round_ms": 1e3 * (res.wall_s - res.prefill_s) / rounds,
                "parts_ms": parts,
                "rounds": rounds,
                "tau": res.tau,
                "verify_rows": statistics.mean(verify_rows) if verify_rows else None,
                "backbone_rows": statistics.mean(backbone_rows) if backbone_rows else None,
            }
            rows_seen[spec, name] = verify_rows, backbone_rows
            del dec
    return out, rows_seen


def kept_taus() -> dict[str, dict]:
    """tau per head in each kept run of TAU_SOURCES (the method's tree checked)."""
    out = {}
    for name, src in TAU_SOURCES.items():
        if not (ROOT / src["file"]).is_file():  # a checkout without the kept runs
            continue
        methods = json.loads((ROOT / src["file"]).read_text())["methods"]
        taus = {}
        for head, method in src["methods"].items():
            m = methods.get(method)
            if m is not None and m.get("tree_spec") == src["tree"]:
                taus[head] = m["tau"]
        out[name] = {"file": src["file"], "tree": src["tree"], "note": src["note"], "tau": taus}
    return out


def predictions(parts: dict, heads: dict[str, dict], engine: dict, rows_seen: dict) -> dict:
    """The speedup model per scenario and head: kappa, nu, rho_tau, predicted speedup over the full head and over
    AR, predicted round ms at a full lookup branch; and beside it the engine's measured round on that tree with the
    model's round at the rows the engine verified."""
    costs = {
        "verify_ms": parts["verify_ms"],
        "drafter_ms": parts["drafter_ms"],
        "drafter_tree_ms": parts["drafter_tree_ms"],
        "heads": heads,
    }
    out = {}
    for scen, src in kept_taus().items():
        tree, taus = TreeConfig.parse(src["tree"]), src["tau"]
        rows = {}
        full_tau = taus.get("full")
        for head, tau in taus.items():
            if head not in heads or full_tau is None:
                continue
            cand = {"tree": src["tree"], "backbone_rows": [max(1, round(tau))], "verify_rows": [tree.max_rows]}
            cand |= {"head_ms": 0.0, "rounds": 1, "accepted": tau}
            p = predict(cand, costs, head, 0.0)
            row = {"tau": tau, "rho_tau": tau / full_tau, "kappa": p["kappa"], "nu": p["nu"]}
            row["predicted_vs_full_head"] = speedup_model(p["kappa"], p["nu"], tau / full_tau)
            row["predicted_vs_ar"] = p["predicted_tok_s"] * parts["ar_step_ms"] / 1e3
            row["predicted_round_ms"] = p["predicted_round_ms"]
            row["predicted_parts_ms"] = p["parts_ms"]
            measured = engine.get("trees", {}).get(src["tree"], {}).get(head)
            if measured is not None:
                v, b = rows_seen[src["tree"], head]
                at = {"tree": src["tree"], "backbone_rows": b, "verify_rows": v, "head_ms": 0.0, "rounds": 1}
                row["measured_round_ms"] = measured["round_ms"]
                row["model_round_ms_at_measured_rows"] = predict(at | {"accepted": 1}, costs, head, 0.0)[
                    "predicted_round_ms"
                ]
            rows[head] = row
        out[scen] = {k: v for k, v in src.items() if k != "tau"} | {"heads": rows}
    return out


def table4(parts: dict, heads: dict[str, dict], engine: dict) -> dict:
    """A draft step as NanoSpec's Table 4 splits it, on the paper's tree (top_k 10, depth 5): the drafter backbone
    (a catch-up pass of 4 rows, about the paper's acceptance, plus 5 tree levels of 10 rows), NanoSpec's set
    update (gather, run synchronously here: the paper overlaps it with the backbone) and the head (a root call and
    5 calls of 10 rows, cold L2); beside the paper's figures and the engine's own split on the same tree."""
    tree = TreeConfig.parse(PAPER_TREE)
    backbone = parts["drafter_ms"][4] + tree.depth * parts["drafter_tree_ms"][tree.top_k]
    out = {}
    for name in ("full", "fr", "nanospec"):
        h = heads.get(name)
        if h is None or tree.top_k not in h:
            continue
        c = h[tree.top_k]
        gather = h["gather"]
        head = c["root"] + tree.depth * c["level"] - (gather or 0.0)
        row = {"backbone": backbone, "gather": gather, "head": head, "total": backbone + head + (gather or 0.0)}
        eng = engine.get("trees", {}).get(PAPER_TREE, {}).get(name)
        if eng is not None:
            row["engine"] = eng["parts_ms"]
        out[name] = {"ours_ms": row, "paper_ms": PAPER_TABLE4[name], "head_key": h["key"]}
    return out


def model_study(
    plan: Plan, device: torch.device, dtype: torch.dtype, head_res: dict, budget: Budget, out, save
) -> None:
    log("8B-shaped target and drafter, random, on the device")
    target, drafter = random_models(plan.model, device, dtype)
    out |= {"config": plan.model, "dtype": str(dtype).removeprefix("torch.")}
    out["target_params"] = sum(p.numel() for p in target.parameters())
    out["drafter_params"] = sum(p.numel() for p in drafter.parameters())
    out["weights_GB"] = round(sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9, 2)
    out["parts"] = model_parts(target, drafter, plan, device, budget)
    save()
    log("engine rounds")
    trees = [TAU_SOURCES["demo"]["tree"], TAU_SOURCES["gemma3-270m"]["tree"], PAPER_TREE]
    out["engine"], rows_seen = engine_rounds(target, drafter, plan, trees, device, budget)
    save()
    del target, drafter
    free(device)
    shape = head_res.get("shapes", {}).get("llama3.1-8b")
    if shape is None or out["parts"]["skipped"]:
        out["predictions"] = {"skipped": "no head study at the llama3.1-8b shape, or verification sizes missing"}
        return
    heads = head_round_costs(shape["heads"], [1, 2, 4, 10])
    if "full" not in heads:
        out["predictions"] = {"skipped": "the head study lacks rows 1, 2, 4 or 10 at the llama3.1-8b shape"}
        return
    out["predictions"] = predictions(out["parts"], heads, out["engine"], rows_seen)
    out["table4"] = table4(out["parts"], heads, out["engine"])


# -- 3. the real targets ---------------------------------------------------------------------------
@torch.inference_mode()
def e2e_target(
    spec: str, drafter_spec: str, dtype: torch.dtype, device: torch.device, plan: Plan, tree: str, budget
) -> dict:
    """AR and every head on the drafter (``demo``: the target's shipped EAGLE-2 drafter), greedy; mismatches
    against the device's AR."""
    target, folder = load_target(spec, dtype, device)
    session = Session(target, folder, load_tokenizer(folder), 2048)
    drafter = resolve_drafter(drafter_spec, target)
    prompts = [session.encode(p) for p in PROMPTS[: plan.prompts]]
    out: dict[str, Any] = {"folder": str(folder), "drafter": drafter.spechead_source, "tree": tree, "methods": {}}
    ar = session.decoder(None)
    ar.generate(prompts[0], 4)  # warm-up
    ref = [ar.generate(ids, plan.max_new) for ids in prompts]
    out["methods"]["ar"] = summary(ref, ref)
    out["skipped"] = {}
    for head in E2E_HEADS:
        if budget.over():
            out["skipped"][head] = "time budget"
            continue
        try:
            dec = session.decoder(drafter, head, tree, guard=None)
        except SpecheadError as e:
            out["skipped"][head] = str(e)
            continue
        dec.generate(prompts[0], 4)
        runs = [dec.generate(ids, plan.max_new) for ids in prompts]
        out["methods"][head] = summary(runs, ref) | {"head": type(dec.head).__name__}
        log(f"  {spec} {head}: {out['methods'][head]['mismatches']} mismatches, tau {out['methods'][head]['tau']:.2f}")
    return out


def summary(runs: list, ref: list) -> dict[str, Any]:
    tokens = sum(len(r.tokens) for r in runs)
    decode_s = sum(r.wall_s - r.prefill_s for r in runs)
    lengths = [n for r in runs for n in r.accept_lengths]
    return {
        "prompts": len(runs),
        "tokens": tokens,
        "decode_tok_s": (tokens - len(runs)) / decode_s if decode_s > 0 else None,
        "tau": sum(lengths) / len(lengths) if lengths else 1.0,
        "mismatches": sum(r.tokens != a.tokens for r, a in zip(runs, ref, strict=True)),
    }


def e2e_study(args, plan: Plan, device: torch.device, budget: Budget, out, save) -> None:
    dtypes = [d for d in args.e2e_dtypes.split(",") if d]
    out |= {"max_new_tokens": plan.max_new, "prompts": plan.prompts, "runs": {}, "skipped": {}}
    for dtype_name in dtypes:
        for name in [t for t in args.targets.split(",") if t]:
            spec = {"demo": args.demo_target, "gemma3-270m": args.gemma_target}.get(name, name)
            drafter = {"demo": args.demo_drafter, "gemma3-270m": args.gemma_drafter}.get(name, "demo")
            key = f"{name} {dtype_name}"
            if budget.over():
                out["skipped"][key] = "time budget"
                continue
            log(f"end to end: {key}")
            try:
                out["runs"][key] = e2e_target(spec, drafter, DTYPES[dtype_name], device, plan, args.tree, budget)
            except (SpecheadError, ImportError, OSError) as e:  # a model package missing, or its files
                out["skipped"][key] = f"{type(e).__name__}: {e}"
                log(f"  skipped: {e}")
            except Exception:  # broke on the device: the other targets still run
                out.setdefault("errors", {})[key] = traceback.format_exc(limit=-6)
                log(f"  FAILED: {out['errors'][key].splitlines()[-1]}")
            save()
            free(device)


# -- the Markdown ----------------------------------------------------------------------------------
def fmt(x: float | None, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    lines = [f"# GPU study: {m.get('device', '?')}", "", f"`{data['command']}`", ""]
    lines.append(f"torch {m.get('torch')}, read {m.get('read_GBps')} GB/s, copy {m.get('copy_GBps')} GB/s (measured)")
    heads = data.get("heads", {})
    for name, res in heads.get("shapes", {}).items():
        rows = [r for r in heads["rows"] if str(r) in res["heads"]["full"]["batches"]]
        lines += ["", f"## Heads at {name} (d {res['d']}, V {res['V']}, {res['dtype']}): ms per call (x bytes floor)"]
        lines += ["", "| head \\ rows | " + " | ".join(map(str, rows)) + " | floor ms at 1 row |"]
        lines.append("|---|" + "---:|" * (len(rows) + 1))
        for h, hr in res["heads"].items():
            b = hr["batches"]
            cells = [f"{b[str(r)]['ms']:.3f} ({b[str(r)]['x_floor_read']:.2f})" for r in rows]
            lines.append(f"| `{h}` | " + " | ".join(cells) + f" | {b['1']['floor_read_ms']:.4f} |")
        if res.get("skipped_batches"):
            lines.append(f"\nrows skipped (time budget): {res['skipped_batches']}")
        for h, why in res["skipped"].items():
            lines.append(f"\n`{h}` not built at this shape: {why}")
    for name, why in heads.get("skipped", {}).items():
        lines.append(f"\nheads at {name}: skipped ({why})")
    model = data.get("model", {})
    if "parts" in model:
        p = model["parts"]
        lines += ["", f"## 8B-shaped target, random weights ({model['dtype']}, {model['weights_GB']} GB)", ""]
        lines.append(f"AR step {p['ar_step_ms']:.3f} ms at {p['context']} tokens of context; verification ms by rows:")
        ver = {int(k): v for k, v in p["verify_ms"].items()}
        shown = [r for r in HEAD_ROWS if r in ver]
        lines += ["", "| rows | " + " | ".join(map(str, shown)) + " |", "|---|" + "---:|" * len(shown)]
        lines.append("| ms | " + " | ".join(f"{ver[r]:.3f}" for r in shown) + " |")
        lines.append("| x AR step | " + " | ".join(f"{ver[r] / p['ar_step_ms']:.2f}" for r in shown) + " |")
        dm = {int(k): v for k, v in p["drafter_ms"].items()}
        lines.append(f"\ndrafter pass (EAGLE-3 layer): {dm[1]:.3f} ms at 1 row, {dm[10]:.3f} ms at 10 rows")
        if p["skipped"]:
            lines.append(f"\nskipped (time budget): {', '.join(p['skipped'])}")
    eng = model.get("engine", {})
    if eng.get("trees"):
        lines += ["", f"### Engine rounds (random weights, no guard; AR {eng['ar_token_ms']:.3f} ms a token)", ""]
        lines += ["| tree | head | round ms | backbone | head | gather | verify | rows verified |"]
        lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
        for tree, hs in eng["trees"].items():
            for h, r in hs.items():
                pp = r["parts_ms"]
                lines.append(
                    f"| {tree} | `{h}` | {r['round_ms']:.3f} | {pp['backbone']:.3f} | {pp['head']:.3f} | "
                    f"{pp['gather']:.3f} | {pp['verify']:.3f} | {fmt(r['verify_rows'], 1)} |"
                )
    if eng.get("skipped"):
        lines.append(f"\nskipped (time budget): {', '.join(eng['skipped'])}")
    for scen, s in model.get("predictions", {}).items():
        if not isinstance(s, dict):
            lines.append(f"\nspeedup model: {scen} ({s})")
            continue
        lines += ["", f"### Speedup model, {scen} acceptance (tree {s['tree']}, tau from `{s['file']}`)", ""]
        lines += ["| head | tau | kappa | nu | rho_tau | predicted vs full | predicted vs AR | model round ms | "
                  "measured round ms | model at measured rows |"]  # fmt: skip
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for h, r in s["heads"].items():
            lines.append(
                f"| `{h}` | {r['tau']:.3f} | {r['kappa']:.3f} | {r['nu']:.3f} | {r['rho_tau']:.3f} | "
                f"{r['predicted_vs_full_head']:.3f} | {r['predicted_vs_ar']:.3f} | {r['predicted_round_ms']:.3f} | "
                f"{fmt(r.get('measured_round_ms'), 3)} | {fmt(r.get('model_round_ms_at_measured_rows'), 3)} |"
            )
    if model.get("table4"):
        lines += ["", f"### A draft step as NanoSpec's Table 4 (tree {PAPER_TREE}; ms, ours / paper)", ""]
        lines += ["| component | " + " | ".join(f"`{h}`" for h in model["table4"]) + " |"]
        lines.append("|---|" + "---:|" * len(model["table4"]))
        for part, label in (("backbone", "draft backbone"), ("gather", "weight gather"), ("head", "draft LM head")):
            cells = [f"{fmt(t['ours_ms'][part], 3)} / {fmt(t['paper_ms'][part], 3)}" for t in model["table4"].values()]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        cells = [f"{t['ours_ms']['total']:.3f} / {t['paper_ms']['total']:.3f}" for t in model["table4"].values()]
        lines.append("| total draft step | " + " | ".join(cells) + " |")
    e2e = data.get("e2e", {})
    if e2e.get("runs") or e2e.get("skipped"):
        lines += ["", f"## Real targets, greedy, {e2e['prompts']} prompt(s) x {e2e['max_new_tokens']} tokens", ""]
        lines += ["| target | method | decode tok/s | tau | mismatches vs AR |", "|---|---|---:|---:|---:|"]
        for key, run in e2e.get("runs", {}).items():
            for meth, r in run["methods"].items():
                lines.append(f"| {key} | `{meth}` | {fmt(r['decode_tok_s'], 1)} | {r['tau']:.2f} | {r['mismatches']} |")
        for key, run in e2e.get("runs", {}).items():
            for meth, why in run.get("skipped", {}).items():
                lines.append(f"\n{key} `{meth}`: skipped ({why})")
        for key, why in e2e.get("skipped", {}).items():
            lines.append(f"\n{key}: skipped ({why})")
    errors = data.get("errors", {}) | e2e.get("errors", {})
    for key, tb in errors.items():
        lines.append(f"\n**{key} failed**: `{tb.strip().splitlines()[-1]}` (traceback in the JSON)")
    lines += ["", f"total {data.get('total_s', '?')} s"]
    return "\n".join(lines) + "\n"


# -- the run ---------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda[:N] (the study) or cpu (its rehearsal)")
    p.add_argument("--small", action="store_true", help="small shapes, fp32, one prompt of 8 tokens (CPU rehearsal)")
    p.add_argument("--out", default="runs/gpu", help="folder for gpu.json and gpu.md")
    p.add_argument("--steps", default="heads,model,e2e", help="which of heads, model, e2e to run")
    p.add_argument("--targets", default="demo,gemma3-270m", help="step 3's targets (demo, gemma3-270m)")
    p.add_argument("--demo-target", default="demo", help="the demo target: its name, a folder or a .gguf file")
    p.add_argument("--gemma-target", default="gemma3-270m", help="Gemma 3 270M: its name, a folder or a .gguf file")
    p.add_argument("--demo-drafter", default="demo", help="the demo's EAGLE-2 drafter: demo (shipped) or a folder")
    p.add_argument("--gemma-drafter", default="demo", help="Gemma's EAGLE-2 drafter: demo (shipped) or a folder")
    p.add_argument("--tree", default=None, help="step 3's tree (default 4x4x16+lookup:8; --small 2x2x5+lookup:8)")
    p.add_argument("--e2e-dtypes", default=None, help="step 3's dtypes (default bf16,fp32; --small fp32)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every step's time budget")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (--device cpu: a shared 2-core box spins)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    else:  # spechead's CPU kernels serve nothing here: not compiling them spares a fresh machine minutes
        os.environ.setdefault("SPECHEAD_KERNELS", "0")
    plan = plan_of(args.small)
    args.tree = args.tree or ("2x2x5+lookup:8" if args.small else "4x4x16+lookup:8")
    args.e2e_dtypes = args.e2e_dtypes or ("fp32" if args.small else "bf16,fp32")
    dtype_name = "fp32" if args.small else "bf16"
    steps = {s for s in args.steps.split(",") if s}
    budget_s = {k: v * args.budget_scale for k, v in plan.budget_s.items()}
    study = Study(Path(args.out), {"command": "python benchmarks/gpu.py " + " ".join(sys.argv[1:])})
    study.data |= {"small": args.small, "dtype": dtype_name, "budget_s": budget_s, "steps_run": []}
    study.data["machine"] = machine(device)
    log(f"{study.data['machine']['device']}: read {study.data['machine']['read_GBps']} GB/s")
    study.save()
    for step in ("heads", "model", "e2e"):
        if step not in steps:
            continue
        budget, t0 = Budget(budget_s[step]), time.perf_counter()
        out: dict[str, Any] = {}
        study.data[step] = out  # filled as the step goes, saved after each shape, tree and target
        try:
            if step == "heads":
                head_study(plan, device, dtype_name, study.data["machine"]["read_GBps"], budget, out, study.save)
            elif step == "model":
                heads = study.data.get("heads", {})
                model_study(plan, device, DTYPES[dtype_name], heads, budget, out, study.save)
            else:
                e2e_study(args, plan, device, budget, out, study.save)
        except Exception as e:  # a step that breaks on the device is reported, and the next one still runs
            study.data.setdefault("errors", {})[step] = traceback.format_exc(limit=-6)
            log(f"{step} FAILED: {type(e).__name__}: {e}")
            free(device)
        study.data["steps_run"].append({"step": step, "s": round(time.perf_counter() - t0, 1)})
        study.data["total_s"] = round(time.perf_counter() - T0, 1)
        study.save()
        log(f"{step} done")
    print(markdown(study.data))
    log(f"wrote {study.out / 'gpu.json'} and {study.out / 'gpu.md'}")


T0 = time.perf_counter()

if __name__ == "__main__":
    main()
