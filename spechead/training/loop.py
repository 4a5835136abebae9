"""The training loop over cached features: packs and their seeded order, the learning-rate schedule,
held-out evaluation, checkpoints and resume, and data-parallel processes (``accelerate launch``).

Everything is seeded per step (the pack order per epoch, each step's sampling generator), so a run
stopped at a checkpoint and resumed retraces the uninterrupted one. The objective is ``training.ttt``.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.model.drafter import Drafter, load_drafter
from spechead.model.layers import Rotary
from spechead.model.transformer import Transformer
from spechead.training.config import TrainConfig, make_drafter
from spechead.training.data import Example
from spechead.training.features import Chunk, assign_chunks, chunk_states, chunks_meta, feature_chunks, load_chunk
from spechead.training.ttt import make_batch, run_ttt


# -- data plan --------------------------------------------------------------------------------------
def plan_packs(lengths: list[list[int]], pack_tokens: int) -> list[tuple[int, int, int]]:
    """(chunk, first example, end example) groups of at most ``pack_tokens`` tokens, in order."""
    packs = []
    for c, ls in enumerate(lengths):
        lo, size = 0, 0
        for j, n in enumerate(ls):
            if j > lo and size + n > pack_tokens:
                packs.append((c, lo, j))
                lo, size = j, 0
            size += n
        if lo < len(ls):
            packs.append((c, lo, len(ls)))
    return packs


def split_packs(packs: list[tuple[int, int, int]], n_chunks: int, eval_packs: int):
    """Held-out: the last ``eval_packs`` packs of the last chunk (at most 10% of all packs, at least one)."""
    last = [p for p in packs if p[0] == n_chunks - 1]
    k = min(len(last), max(1, min(eval_packs, len(packs) // 10))) if len(packs) > 1 else 0
    held = last[len(last) - k :] if k else []
    return [p for p in packs if p not in held], held


def epoch_order(train: list[tuple[int, int, int]], seed: int, epoch: int) -> list[tuple[int, int, int]]:
    """Chunks in a random order, packs shuffled within each chunk (one chunk in memory at a time)."""
    rng = random.Random(seed * 1000003 + epoch)
    by_chunk: dict[int, list] = {}
    for p in train:
        by_chunk.setdefault(p[0], []).append(p)
    order = list(by_chunk)
    rng.shuffle(order)
    out = []
    for c in order:
        ps = by_chunk[c][:]
        rng.shuffle(ps)
        out += ps
    return out


def lr_at(step: int, total: int, cfg: TrainConfig, progress: float | None = None) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` x lr over the steps, or over ``progress`` (the
    fraction of a time budget spent) when the run is timed."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup)) if progress is None else min(1.0, progress)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class ChunkCache:
    """Cached feature chunks from disk, one in memory at a time."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.idx, self.chunk = paths, -1, None

    def get(self, c: int) -> Chunk:
        if c != self.idx:
            self.chunk, self.idx = load_chunk(self.paths[c]), c
        return self.chunk


class OnlineChunks(ChunkCache):
    """Feature chunks computed by the target when a pack of them is first needed, never written: on a GPU the
    target's forward costs less than storing its states (EAGLE-3's are 4 x d values a token) and reading them back.
    The chunks are ``extract``'s, so the packs, their order and the held-out split are a cached run's."""

    def __init__(
        self, target: Transformer, examples: list[Example], chunk_tokens: int, pack_tokens: int, aux: bool
    ) -> None:
        self.target, self.pack_tokens, self.aux = target, pack_tokens, aux
        self.chunks = assign_chunks(examples, chunk_tokens)
        self.device = target.lm_head.weight.device
        super().__init__([])
        target.setup_cache(pack_tokens)

    def meta(self) -> dict[str, Any]:
        return {**chunks_meta(self.target, self.chunks, self.aux), "data": "online"}

    def get(self, c: int) -> Chunk:
        if c != self.idx:
            self.chunk = None  # the previous chunk's states leave the device first
            self.chunk = chunk_states(
                self.target, self.chunks[c], self.aux, self.pack_tokens, torch.bfloat16, self.device
            )
            self.idx = c
        return self.chunk


@torch.no_grad()
def evaluate(drafter, target, cache: ChunkCache, held, cfg: TrainConfig, teacher=None) -> dict[str, Any]:
    """Top-1 / top-k agreement with the target (or the teacher head) per TTT step on held-out packs."""
    was = drafter.training
    drafter.eval()
    n_steps = cfg.n_steps
    acc1 = [[0, 0] for _ in range(n_steps)]
    acck = [[0, 0] for _ in range(n_steps)]
    ce = [[0.0, 0] for _ in range(n_steps)]
    for j, (c, lo, hi) in enumerate(held):
        b = make_batch(cache.get(c), lo, hi).to(target.lm_head.weight.device)
        out = run_ttt(drafter, target, b, cfg, torch.Generator().manual_seed(j), teacher, cfg.eval_positions)
        for i in range(n_steps):
            acc1[i][0] += out.top1[i][0]
            acc1[i][1] += out.top1[i][1]
            acck[i][0] += out.topk[i][0]
            acck[i][1] += out.topk[i][1]
            if out.top1[i][1]:
                ce[i][0] += out.ce[i] * out.top1[i][1]
                ce[i][1] += out.top1[i][1]
    drafter.train(was)
    return {
        "top1": [a / max(1, n) for a, n in acc1],
        f"top{cfg.topk}": [a / max(1, n) for a, n in acck],
        "ce": [a / max(1, n) for a, n in ce],
        "positions": acc1[0][1],
    }


# -- checkpoints ------------------------------------------------------------------------------------
def save_checkpoint(folder: Path, drafter: Drafter, opt, state: dict[str, Any]) -> None:
    ck = folder / "checkpoint"
    tmp = folder / "checkpoint.tmp"
    drafter.save(tmp, dtype=torch.float32)
    torch.save({"optimizer": opt.state_dict(), **state}, tmp / "train_state.pt")
    if ck.exists():
        old = folder / "checkpoint.old"
        os.replace(ck, old)
        os.replace(tmp, ck)
        for p in old.iterdir():
            p.unlink()
        old.rmdir()
    else:
        os.replace(tmp, ck)


def load_train_state(folder: Path) -> dict[str, Any] | None:
    path = folder / "checkpoint" / "train_state.pt"
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def restore_optimizer(opt: torch.optim.Optimizer, state: dict[str, Any], fused: bool) -> None:
    """Load a checkpoint's optimizer state for this run's device: ``load_state_dict`` would bring back the saved
    groups' ``fused`` flag too, so a GPU run's checkpoint resumed on the CPU (or an older one on a GPU) would take the
    other update path; the flag and the step counters (on the parameters' device when fused) follow this run."""
    opt.load_state_dict(state)
    for g in opt.param_groups:
        g["fused"] = fused or None
        for p in g["params"]:
            st = opt.state.get(p, {})
            if "step" in st:
                st["step"] = st["step"].to(p.device if fused else "cpu", torch.float32)


def param_checksum(drafter: Drafter) -> float:
    return float(sum(p.detach().double().sum() for p in drafter.parameters() if p.requires_grad))


# -- the loop ---------------------------------------------------------------------------------------
def ready_features(features: Path) -> tuple[list[Path], dict[str, Any]]:
    """The chunks and meta to train on: an extraction still running (or stopped early) leaves chunks 0..n-1."""
    paths = feature_chunks(features)
    try:
        meta = json.loads((features / "meta.json").read_text())
        meta["lengths"]  # noqa: B018
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecheadError(f"{features / 'meta.json'} is corrupt ({e}); extract the features again") from None
    n_ready = next((i for i, p in enumerate(paths) if p.name != f"chunk_{i:05d}.pt"), len(paths))
    meta["lengths"] = meta["lengths"][:n_ready]
    return paths[:n_ready], meta


def unroll_ready(drafter: Drafter) -> None:
    """The drafter as ``run_ttt`` needs it: RoPE for packed positions, attention without the decoding cache."""
    drafter.rotary = Rotary(drafter.config.head_dim, 8192, drafter.config.rope_theta, drafter.config.rope_scaling)
    drafter.layer.self_attn.cache = None


def train(
    target: Transformer,
    features: Path | None,
    out: Path,
    cfg: TrainConfig,
    init: str | None = None,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
    online: OnlineChunks | None = None,
    max_minutes: float | None = None,
) -> dict[str, Any]:
    """Train a drafter on cached features (or on ``online`` ones); returns the final metrics (also written to
    metrics.json). The drafter trains on the target's device.

    ``stop_after`` ends this call after that many steps (checkpointed) without changing the schedule,
    so a long run can be done in slots; rerunning resumes from the checkpoint. ``max_minutes`` times the run
    instead: the learning rate decays over the budget (the step total then counts only if ``cfg.max_steps`` sets
    one) and the run ends, checkpointed, evaluated and saved, when it is spent; a resumed timed run continues the
    clock from its checkpoint (rerun with the same budget, a finished one trains nothing more; the steps a resumed
    run takes differ from an uninterrupted run's).
    """
    dist = _distributed()
    try:
        return _train(dist, target, features, out, cfg, init, resume, progress, stop_after, online, max_minutes)
    finally:  # a process left to exit with its group alive can abort in gloo's teardown ("terminate called ...")
        if dist:
            dist.destroy_process_group()


def _train(
    dist,
    target: Transformer,
    features: Path | None,
    out: Path,
    cfg: TrainConfig,
    init: str | None,
    resume: bool,
    progress: bool,
    stop_after: int | None,
    online: OnlineChunks | None,
    max_minutes: float | None,
) -> dict[str, Any]:
    from tqdm import tqdm

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    if dist and max_minutes:
        raise SpecheadError("a timed run (--max-minutes) is one process: each would stop at another step")
    device = target.lm_head.weight.device
    if online is not None:
        if online.target is not target:
            raise SpecheadError("online features must come from the target being trained against")
        paths, meta = [], online.meta()
    elif features is None:
        raise SpecheadError("nothing to train on: give a features folder or online features")
    else:
        paths, meta = ready_features(features)
    if meta.get("hidden_size") != target.config.hidden_size or meta.get("vocab_size") != target.config.vocab_size:
        raise SpecheadError(f"features in {features} were extracted from another target")
    torch.manual_seed(cfg.seed)
    ck_state = load_train_state(out) if resume else None
    drafter, teacher = make_drafter(target, cfg, init)
    if ck_state is not None:
        saved = load_drafter(out / "checkpoint", target).float()
        drafter.load_state_dict(saved.state_dict(), strict=False)
    unroll_ready(drafter)
    drafter.to(device)
    teacher = teacher.to(device) if teacher is not None else None
    params = [p for p in drafter.parameters() if p.requires_grad]
    fused = device.type == "cuda"  # one kernel for the whole update on a GPU; the CPU keeps its reference path
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)
    packs = plan_packs(meta["lengths"], cfg.pack_tokens)
    train_packs, held = split_packs(packs, len(meta["lengths"]), cfg.eval_packs)
    if not train_packs:
        raise SpecheadError("not enough data to train (every pack was held out)")
    per_epoch = len(train_packs) // world
    budget_s = max_minutes * 60 if max_minutes else None
    total = cfg.max_steps or (sys.maxsize if budget_s else max(1, int(math.ceil(per_epoch * cfg.epochs))))
    step, epoch, pos, spent_s = 0, 0, 0, 0.0
    if ck_state is not None:
        restore_optimizer(opt, ck_state["optimizer"], fused)
        step, epoch, pos = ck_state["step"], ck_state["epoch"], ck_state["pos"]
        spent_s = ck_state.get("elapsed_s", 0.0) if budget_s else 0.0  # a spent budget: nothing left to train
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "train_log.jsonl").open("a") if rank == 0 else None
    cache = online if online is not None else ChunkCache(paths)
    bar = tqdm(
        total=None if total == sys.maxsize else total,
        initial=step,
        desc=f"train {cfg.arch}",
        disable=not progress or rank,
        dynamic_ncols=True,
    )
    t0, tokens_seen, ema = time.perf_counter(), 0, None
    clock0 = t0 - spent_s  # a timed run's clock, continued across resumes

    def checkpoint() -> None:
        state = {"step": step, "epoch": epoch, "pos": pos, "config": asdict(cfg)}
        save_checkpoint(out, drafter, opt, {**state, "elapsed_s": time.perf_counter() - clock0})

    order = epoch_order(train_packs, cfg.seed, epoch)
    end = total if stop_after is None else min(total, step + stop_after)
    while step < end:
        spent = (time.perf_counter() - clock0) / budget_s if budget_s else None
        if spent is not None and spent >= 1:  # the time budget is spent: the run ends here, finished
            total = end = step
            if rank == 0:
                stop = {"step": step, "stopped": "time budget spent", "elapsed_s": _elapsed(clock0)}
                log.write(json.dumps(stop) + "\n")
                checkpoint()
            break
        if pos + world > len(order):
            epoch, pos = epoch + 1, 0
            order = epoch_order(train_packs, cfg.seed, epoch)
        c, lo, hi = order[pos + rank]
        pos += world
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg, spent)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + step * world + rank)
        res = run_ttt(drafter, target, make_batch(cache.get(c), lo, hi).to(device), cfg, gen, teacher)
        opt.zero_grad(set_to_none=False)
        res.loss.backward()
        if dist:
            _all_reduce_grads(params, dist, world)
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        opt.step()
        step += 1
        tokens_seen += res.tokens * world
        loss = float(res.loss.detach())
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        rate = tokens_seen / (time.perf_counter() - t0)
        acc = res.top1[0][0] / max(1, res.top1[0][1])
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{acc:.2f}", tok_s=f"{rate:.0f}")
        bar.update(1)
        if log and (step % cfg.log_every == 0 or step == total):
            rec = {"step": step, "epoch": epoch, "loss": loss, "loss_ema": ema, "ce": res.ce, "top1_0": acc}
            rec.update(
                lr=lr_at(step - 1, total, cfg, spent), grad_norm=gnorm, tokens_per_s=rate, elapsed_s=_elapsed(t0)
            )
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if cfg.eval_every and step % cfg.eval_every == 0 and rank == 0 and held:
            ev = evaluate(drafter, target, cache, held, cfg, teacher)
            log.write(json.dumps({"step": step, "eval": ev}) + "\n")
            log.flush()
        if rank == 0 and (step % cfg.save_every == 0 or step == end):
            checkpoint()
    bar.close()
    if step < total:  # stopped early on purpose: the checkpoint is the state
        if log:
            log.close()
        return {"steps": step, "total_steps": total}
    metrics: dict[str, Any] = {"steps": step, "epochs": step * world / max(1, len(train_packs)), "world": world}
    metrics["param_checksum"] = param_checksum(drafter)
    if rank == 0:
        if held:
            metrics["eval"] = evaluate(drafter, target, cache, held, cfg, teacher)
        metrics["train_tokens_per_s"] = tokens_seen / max(1e-9, time.perf_counter() - t0)
        metrics["config"] = asdict(cfg)
        metrics["features"] = {k: meta.get(k) for k in ("tokens", "targets", "examples", "chunks", "data")}
        drafter.save(out)  # the deployable bf16 drafter
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        log.close()
    if dist:
        (out / f"checksum_rank{rank}.json").write_text(json.dumps({"param_checksum": metrics["param_checksum"]}))
        dist.barrier()
    return metrics


def _elapsed(t0: float) -> float:
    return round(time.perf_counter() - t0, 1)


def _distributed():
    """torch.distributed when launched by ``accelerate launch`` (gloo on CPU), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    PartialState(cpu=True, backend="gloo")  # initialises the process group from accelerate's environment
    import torch.distributed as dist

    return dist


def _all_reduce_grads(params: list[Tensor], dist, world: int) -> None:
    """Average gradients over processes with one flat all-reduce."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        if p.grad is None:
            p.grad = flat[off : off + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[off : off + n].view_as(p))
        off += n
