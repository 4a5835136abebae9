"""Drafter training: the TTT unroll equals inference, SlimSpec SVD init, save/load, resume, two processes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import write_tiny_llama
from test_data import write_chat_tokenizer, write_jsonl

from spechead.cli.commands import main as cli_main
from spechead.decoding.decoder import Decoder
from spechead.decoding.session import Session
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.lowrank import LowRankHead
from spechead.model.drafter import load_drafter
from spechead.model.layers import Rotary
from spechead.model.loading import load_target
from spechead.model.tokenizer import load_tokenizer
from spechead.training.config import TrainConfig, make_drafter
from spechead.training.data import load_examples
from spechead.training.features import extract_features, load_chunk
from spechead.training.loop import (
    ChunkCache,
    OnlineChunks,
    evaluate,
    lr_at,
    plan_packs,
    restore_optimizer,
    split_packs,
    train,
)
from spechead.training.ttt import make_batch, run_ttt

WORDS = ["the cat sat", "on the mat", "a dog ran", "to the park", "i like tea", "we go home"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny chat target, a small chat data file and its cached features (with EAGLE-3 states)."""
    root = tmp_path_factory.mktemp("train")
    folder = write_chat_tokenizer(write_tiny_llama(root / "target"))
    g = torch.Generator().manual_seed(0)

    def phrase(n):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))

    recs = [
        {"messages": [{"role": "user", "content": phrase(2)}, {"role": "assistant", "content": phrase(4)}]}
        for _ in range(40)
    ]
    data = write_jsonl(root / "chat.jsonl", recs)
    target, _ = load_target(str(folder))
    target.setup_cache(512)
    examples = load_examples(load_tokenizer(folder), [data], max_len=128)
    feats = root / "features"
    total = sum(len(e.ids) for e in examples[:20])  # two chunks: the second is held out
    extract_features(target, examples, feats, True, chunk_tokens=total, pack_tokens=512, progress=False)
    return folder, target, data, feats


def _held_out(target, feats, cfg, drafter, teacher=None):
    paths = sorted(feats.glob("chunk_*.pt"))
    meta = json.loads((feats / "meta.json").read_text())
    _, held = split_packs(plan_packs(meta["lengths"], cfg.pack_tokens), len(paths), cfg.eval_packs)
    return evaluate(_fresh(drafter), target, ChunkCache(paths), held, cfg, teacher)


def _fresh(drafter):
    drafter.rotary = Rotary(drafter.config.head_dim, 512, drafter.config.rope_theta)
    drafter.layer.self_attn.cache = None
    return drafter


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_training_unroll_matches_inference(setup, arch):
    """Step 0 is the drafter's causal forward; step 1 at index t is tree drafting one level below t."""
    _, target, _, feats = setup
    cfg = TrainConfig(arch=arch, steps_ttt=2)
    drafter, _ = make_drafter(target, cfg)
    chunk = load_chunk(feats / "chunk_00000.pt")
    b = make_batch(chunk, 0, 1)  # one example
    states: list[torch.Tensor] = []
    with torch.no_grad():
        run_ttt(_fresh(drafter).eval(), target, b, cfg, torch.Generator().manual_seed(0), states=states)
    n = b.ids.numel()
    feat = (b.aux if arch == "eagle3" else b.hidden).float()
    drafter.setup_cache(n + 4)
    with torch.no_grad():
        h0 = drafter(b.ids[1:], feat[: n - 1], 0, torch.arange(n - 1), None)
        torch.testing.assert_close(states[0][: n - 1], h0, atol=1e-5, rtol=1e-4)
        for t in (0, 3, n - 4):
            drafter(b.ids[1 : t + 2], feat[: t + 1], 0, torch.arange(t + 1), None)  # the prefix 0..t
            h1 = drafter(b.ids[t + 2 : t + 3], h0[t : t + 1], t + 1, torch.tensor([t + 1]), None)
            torch.testing.assert_close(states[1][t : t + 1], h1, atol=1e-5, rtol=1e-4)


def test_svd_init_reproduces_the_full_head_within_the_truncation_error(tmp_path, setup):
    from spechead.model.lowrank import LowRankLinear

    folder, target, _, _ = setup
    full, _ = make_drafter(target, TrainConfig(arch="eagle3"))
    with torch.no_grad():
        full.norm.weight.uniform_(0.5, 1.5)
    full.save(tmp_path / "full", dtype=torch.float32)
    drafter, teacher = make_drafter(target, TrainConfig(arch="eagle3", head="lowrank:8"), init=str(tmp_path / "full"))
    head = drafter.low_rank_head
    assert isinstance(head, LowRankLinear) and head.rank == 8
    w = target.lm_head.weight.float()
    torch.testing.assert_close(teacher, w)
    s = torch.linalg.svdvals(w.double())
    h = torch.randn(64, w.shape[1], generator=torch.Generator().manual_seed(0))
    err = (head(h) - h @ w.T).double().norm(dim=-1)
    assert bool((err <= s[8] * h.double().norm(dim=-1) * (1 + 1e-4)).all())  # spectral bound
    frob = (head.dense() - w).double().norm()
    torch.testing.assert_close(frob, s[8:].pow(2).sum().sqrt(), rtol=1e-4, atol=1e-5)  # Eckart-Young
    assert float(err.detach().mean()) > 0  # rank 8 < 32 really truncates


def test_lowrank_drafter_round_trips_and_stays_lossless(setup, tmp_path):
    folder, target, _, _ = setup
    drafter, _ = make_drafter(target, TrainConfig(arch="eagle3", head="lowrank:8", lowrank_init="random"))
    path = drafter.save(tmp_path / "lr", dtype=torch.float32)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["lm_head_rank"] == 8 and cfg["tie_lm_head_to_target"] is False
    loaded = load_drafter(path, target)
    for k, v in drafter.checkpoint_state().items():
        torch.testing.assert_close(loaded.checkpoint_state()[k], v.float())
    assert loaded.low_rank_head.up.weight.shape == (64, 8)
    w, _ = loaded.head_weight(target)
    torch.testing.assert_close(w, loaded.low_rank_head.dense())
    ar = Decoder(target, max_len=256)
    prompt = [0, 5, 9, 11, 7]
    ref = ar.generate(prompt, 24, speculative=False).tokens
    head = LowRankHead(loaded.low_rank_head, None, target.config.vocab_size)
    spec = Decoder(target, loaded, head, TreeConfig(2, 2, 5), 256).generate(prompt, 24)
    assert spec.tokens == ref
    # Session.decoder decodes such a drafter with its own factors ("full" = its own head; lowrank:R re-truncates)
    session = Session(target, folder, load_tokenizer(folder), 256)
    for spec_name, rank in (("full", 8), ("lowrank", 8), ("lowrank:4", 4)):
        dec = session.decoder(loaded, spec_name, TreeConfig(2, 2, 5))
        assert isinstance(dec.head, LowRankHead) and dec.head.scorer.rank == rank
    assert dec.generate(prompt, 24).tokens == ref


def test_training_learns_and_resume_retraces(setup, tmp_path):
    folder, target, _, feats = setup
    cfg = TrainConfig(arch="eagle2", max_steps=8, warmup=2, lr=1e-2, pack_tokens=256, save_every=4, ce_weight=1.0)
    a = train(target, feats, tmp_path / "a", cfg, progress=False)
    b1 = train(target, feats, tmp_path / "b", cfg, progress=False, stop_after=4)
    assert b1["steps"] == 4
    b2 = train(target, feats, tmp_path / "b", cfg, progress=False)
    assert b2["steps"] == 8
    sa = load_drafter(tmp_path / "a" / "checkpoint", target).state_dict()
    sb = load_drafter(tmp_path / "b" / "checkpoint", target).state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-6, rtol=1e-5)
    assert a["eval"]["positions"] > 0 and len(a["eval"]["top1"]) == 1
    untrained = _held_out(target, feats, cfg, make_drafter(target, cfg)[0])
    assert a["eval"]["ce"][0] < untrained["ce"][0]  # it learned something about the target's distribution
    assert load_drafter(tmp_path / "a", target).arch == "eagle2"  # the bf16 deliverable loads


def test_a_checkpoint_resumes_on_this_runs_optimizer_path():
    """A GPU run's AdamW is fused; resumed on the CPU it must take the CPU's reference path, as a run started there."""
    p = torch.nn.Parameter(torch.ones(3))
    fused = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones(3)
    fused.step()
    opt = torch.optim.AdamW([p], lr=0.1)
    saved = fused.state_dict()
    restore_optimizer(opt, copy.deepcopy(saved), fused=False)
    assert opt.param_groups[0]["fused"] is None and opt.state[p]["step"].device.type == "cpu"
    ref = torch.optim.AdamW([q := torch.nn.Parameter(p.detach().clone())], lr=0.1)
    ref.load_state_dict(copy.deepcopy(saved))
    ref.param_groups[0]["fused"] = None
    p.grad, q.grad = torch.full((3,), 0.5), torch.full((3,), 0.5)
    opt.step()
    ref.step()
    assert torch.equal(p, q)


def test_posthoc_lowrank_distillation_trains_only_the_head(setup, tmp_path):
    folder, target, _, feats = setup
    base = train(target, feats, tmp_path / "e3", TrainConfig(arch="eagle3", steps_ttt=2, max_steps=2), progress=False)
    assert base["steps"] == 2
    cfg = TrainConfig(
        arch="eagle3",
        head="lowrank:4",
        lowrank_init="random",
        freeze_backbone=True,
        steps_ttt=2,
        max_steps=6,
        warmup=1,
        lr=2e-2,
    )
    m = train(target, feats, tmp_path / "lr", cfg, init=str(tmp_path / "e3" / "checkpoint"), progress=False)
    before = load_drafter(tmp_path / "e3" / "checkpoint", target).state_dict()
    after = load_drafter(tmp_path / "lr" / "checkpoint", target)
    for k, v in after.state_dict().items():
        if not k.startswith("lm_head."):
            torch.testing.assert_close(v, before[k])
    start, teacher = make_drafter(target, cfg, init=str(tmp_path / "e3" / "checkpoint"))
    assert m["eval"]["ce"][0] < _held_out(target, feats, cfg, start, teacher)["ce"][0]
    # the SlimSpec way instead: the low-rank head learns the target's distribution with the backbone, no teacher
    joint = TrainConfig(arch="eagle3", head="lowrank:4", lowrank_teacher="target")
    drafter, teacher = make_drafter(target, joint, init=str(tmp_path / "e3" / "checkpoint"))
    assert teacher is None and drafter.low_rank_head is not None


def _setup_examples(folder, data):
    examples = load_examples(load_tokenizer(folder), [data], max_len=128)
    return examples, sum(len(e.ids) for e in examples[:20])  # the fixture's chunking: two chunks


def _train_online(target, folder, data, out, cfg):
    """``train`` on the fixture's chunks computed online by ``target`` (with EAGLE-3 states for eagle3)."""
    examples, chunk_tokens = _setup_examples(folder, data)
    online = OnlineChunks(target, examples, chunk_tokens, 512, cfg.arch == "eagle3")
    return train(target, None, out, cfg, progress=False, online=online)


def test_online_features_train_as_cached_ones(setup, tmp_path):
    """``--online`` computes extract's chunks when training needs them: the same packs, order and held-out split,
    the same states, so the same run ends with the same weights and held-out figures as on cached features."""
    folder, target, data, feats = setup
    cfg = TrainConfig(arch="eagle3", steps_ttt=2, max_steps=6, warmup=2, lr=1e-2, pack_tokens=256)
    cached = train(target, feats, tmp_path / "cached", cfg, progress=False)
    online = _train_online(target, folder, data, tmp_path / "online", cfg)
    assert online["param_checksum"] == cached["param_checksum"]
    assert online["eval"] == cached["eval"]
    assert online["features"]["tokens"] == json.loads((feats / "meta.json").read_text())["tokens"]


def test_a_timed_run_decays_over_the_clock_ends_finished_and_stays_finished(setup, tmp_path):
    folder, target, data, _ = setup
    examples, chunk_tokens = _setup_examples(folder, data)
    cfg = TrainConfig(arch="eagle2", warmup=1, pack_tokens=256, log_every=1, save_every=10**6)
    assert lr_at(5, 10**6, cfg, 0.0) == cfg.lr and lr_at(5, 10**6, cfg, 1.0) == cfg.lr * cfg.min_lr_ratio
    online = OnlineChunks(target, examples, chunk_tokens, 512, False)
    m = train(target, None, tmp_path / "timed", cfg, progress=False, online=online, max_minutes=0.05)
    lengths = online.meta()["lengths"]
    one_epoch = len(split_packs(plan_packs(lengths, 256), len(lengths), cfg.eval_packs)[0])
    assert m["steps"] > one_epoch  # the clock, not the one epoch an untimed run would take, ended it
    log = [json.loads(line) for line in (tmp_path / "timed" / "train_log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in log if "lr" in r]
    assert log[-1]["stopped"] == "time budget spent" and log[-1]["step"] == m["steps"]
    assert lrs[-1] < 0.35 * cfg.lr < max(lrs)  # the cosine ran over the budget, down to near its floor
    saved = load_drafter(tmp_path / "timed", target).state_dict()
    again = train(target, None, tmp_path / "timed", cfg, progress=False, online=online, max_minutes=0.05)
    assert again["steps"] == m["steps"]  # finished: a rerun resumes to the end and trains nothing more
    for k, v in load_drafter(tmp_path / "timed", target).state_dict().items():
        torch.testing.assert_close(v, saved[k])
    with pytest.raises(SpecheadError, match="nothing to train on"):
        train(target, None, tmp_path / "none", cfg, progress=False)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
)
def test_extract_on_a_device(setup, tmp_path, device, monkeypatch):
    """``spechead extract --device``: the target runs there (once for every drafter that trains on the chunks), the
    chunks are the fixture's, in host memory; on the CPU bitwise, on a GPU within bf16 rounding of the CPU's states."""
    folder, _, data, feats = setup
    total = _setup_examples(folder, data)[1]  # the fixture's chunking
    out = tmp_path / "feats"
    args = ["extract", "--target", str(folder), "--data", str(data), "--features", str(out), "--arch", "eagle3"]
    args += ["--max-len", "128"]
    import spechead.training.extract as extract

    ran_on = []
    monkeypatch.setattr(extract, "load_target", lambda *a, **k: ran_on.append(str(k["device"])) or load_target(*a, **k))
    tf32 = torch.backends.cuda.matmul.allow_tf32  # a GPU's extraction turns TF32 on for the process
    try:
        assert cli_main([*args, "--chunk-tokens", str(total), "--pack-tokens", "512", "--device", device]) == 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert ran_on == [device]
    want, got = sorted(feats.glob("chunk_*.pt")), sorted(out.glob("chunk_*.pt"))
    assert [p.name for p in got] == [p.name for p in want] and len(got) == 2
    for a, b in zip(want, got, strict=True):
        ca, cb = load_chunk(a), load_chunk(b)
        assert torch.equal(ca.ids, cb.ids) and torch.equal(ca.starts, cb.starts)
        assert torch.load(b, weights_only=True)["hidden"].device.type == "cpu"  # written from host memory
        tol = {"atol": 0, "rtol": 0} if device == "cpu" else {"atol": 0.05, "rtol": 0.02}
        torch.testing.assert_close(cb.hidden.float(), ca.hidden.float(), **tol)
        torch.testing.assert_close(cb.aux.float(), ca.aux.float(), **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_online_training_on_a_gpu(setup, tmp_path):
    """The device path (CPU machines skip it): online states on the GPU, the drafter trained there loads on the CPU."""
    folder, _, data, feats = setup
    gpu_target, _ = load_target(str(folder), device="cuda")
    cfg = TrainConfig(arch="eagle3", steps_ttt=2, max_steps=6, warmup=2, lr=1e-2, pack_tokens=256)
    m = _train_online(gpu_target, folder, data, tmp_path / "gpu", cfg)
    assert m["steps"] == 6
    target = setup[1]
    untrained = _held_out(target, feats, cfg, make_drafter(target, cfg)[0])
    trained = _held_out(target, feats, cfg, load_drafter(tmp_path / "gpu", target).float())
    assert trained["ce"][0] < untrained["ce"][0]


def test_bad_training_input(setup, tmp_path, capsys):
    folder, target, data, feats = setup
    with pytest.raises(SpecheadError, match="rank must be"):
        make_drafter(target, TrainConfig(arch="eagle3", head="lowrank:32"))  # d = 32
    with pytest.raises(SpecheadError, match="needs --arch eagle3"):
        make_drafter(target, TrainConfig(arch="eagle2", head="lowrank:4"))
    with pytest.raises(SpecheadError, match="unknown training head"):
        make_drafter(target, TrainConfig(arch="eagle3", head="nano"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc = cli_main(["train-drafter", "--target", str(folder), "--data", str(empty), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("spechead: error:") and "no records" in err and "\n" not in err


def test_two_process_training_with_accelerate(setup, tmp_path):
    """``accelerate launch`` with two CPU processes (gloo): gradients are averaged, replicas stay equal."""
    folder, _, _, feats = setup
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517"]
    cmd += ["-m", "spechead.cli", "train-drafter", "--target", str(folder), "--features", str(feats)]
    cmd += ["--out", str(out), "--max-steps", "3", "--pack-tokens", "256", "--quiet", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stderr[:3000] + "\n...\n" + res.stderr[-1500:]
    sums = [json.loads((out / f"checksum_rank{r}.json").read_text())["param_checksum"] for r in (0, 1)]
    assert sums[0] == sums[1]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world"] == 2 and metrics["steps"] == 3
    assert (out / "model.safetensors").is_file()


def test_whitened_factors_are_svd_for_isotropic_states_and_better_for_others():
    from spechead.model.lowrank import svd_factors, whitened_factors

    g = torch.Generator().manual_seed(7)
    w = torch.randn(300, 24, generator=g, dtype=torch.float64)
    up, down = svd_factors(w, 6)
    proj, fdown = whitened_factors(w, 6, torch.eye(24, dtype=torch.float64))
    torch.testing.assert_close(w @ proj @ fdown, up @ down)
    # states living mostly in a few directions: the fitted factors spend the rank there
    mix = torch.randn(24, 24, generator=g, dtype=torch.float64) * torch.logspace(0, -3, 24, dtype=torch.float64)
    h = torch.randn(4000, 24, generator=g, dtype=torch.float64) @ mix.T
    moment = h.T @ h / h.shape[0]
    proj, fdown = whitened_factors(w, 6, moment)

    def err(full_minus_approx):
        return float(((h @ full_minus_approx.T) ** 2).sum(-1).mean())

    assert err(w - w @ proj @ fdown) < 0.5 * err(w - up @ down)


def test_fitted_low_rank_head_round_trips_and_its_twin_is_the_same_drafter(setup, tmp_path):
    from spechead.model.drafter import LOW_RANK_FILE, random_drafter
    from spechead.training.lowrank_fit import fit_low_rank_head

    folder, target, _, feats = setup
    path = random_drafter(target, "eagle2", seed=2).float().save(tmp_path / "e2", dtype=torch.float32)
    report = fit_low_rank_head(target, path, feats, rank=8, fit_tokens=200, eval_tokens=40)
    assert (path / LOW_RANK_FILE).is_file() and report["rank"] == 8 and report["fit_states"] == 200
    assert 0.0 <= report["top1_agreement_svd"] <= 1.0 and 0.0 <= report["top1_agreement_fitted"] <= 1.0
    loaded = load_drafter(path, target)
    from safetensors.torch import load_file

    proj = load_file(path / LOW_RANK_FILE)["proj"]  # the stored factors recompute up = W @ proj exactly
    torch.testing.assert_close(loaded.low_rank_head.up.weight, target.lm_head.weight @ proj)
    session = Session(target, folder, load_tokenizer(folder), 256)
    full = session.decoder(loaded, "full", TreeConfig(2, 2, 5))
    low = session.decoder(loaded, "lowrank", TreeConfig(2, 2, 5))
    assert not isinstance(full.head, LowRankHead) and isinstance(low.head, LowRankHead)
    assert low.head.scorer.rank == 8
    prompt = [0, 5, 9, 11, 7]
    ref = Decoder(target, max_len=256).generate(prompt, 24, speculative=False).tokens
    assert low.generate(prompt, 24).tokens == ref == full.generate(prompt, 24).tokens
    # the benchmark compares it with the same drafter's full head, whichever method names the folder first
    from spechead.bench.methods import check_methods
    from spechead.bench.runners import build_runners

    specs = check_methods(["lowrank", "eagle"], TreeConfig(2, 2, 5))
    build_runners(session, specs, {k: str(path) for k in ("eagle2", "eagle3", "lowrank")}, log=lambda _: None)
    assert specs[0].twin == "eagle2" and specs[0].reference(specs) is specs[1]
    (path / LOW_RANK_FILE).write_bytes(b"garbage")
    with pytest.raises(SpecheadError, match="corrupt"):
        load_drafter(path, target)


def test_a_corrupt_features_meta_is_named(tmp_path):
    from spechead.training.loop import ready_features

    (tmp_path / "meta.json").write_text('{"lengths": [3,')
    (tmp_path / "chunk_00000.pt").write_bytes(b"")  # a chunk is there: only the meta is wrong
    with pytest.raises(SpecheadError, match="meta.json is corrupt"):
        ready_features(tmp_path)
