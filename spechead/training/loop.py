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
    if dist and max_minutes:
        raise SpecheadError("a timed run (--max-minutes) is one process: each would stop at another step")
    paths, meta = _training_data(target, features, online)
    run = _Run(dist, target, out, cfg, paths, meta, init, resume, progress, online, max_minutes)
    end = run.total if stop_after is None else min(run.total, run.step + stop_after)
    while run.step < end:
        spent = run.spent()
        if spent is not None and spent >= 1:  # the time budget is spent: the run ends here, finished
            run.stop_for_time()
            break
        run.train_step(spent, end)
    run.bar.close()
    if run.step < run.total:  # stopped early on purpose: the checkpoint is the state
        if run.log:
            run.log.close()
        return {"steps": run.step, "total_steps": run.total}
    return run.finish()


def _training_data(
    target: Transformer, features: Path | None, online: OnlineChunks | None
) -> tuple[list[Path], dict[str, Any]]:
    """The feature chunks and their meta (no chunks for ``online`` features), checked against the target."""
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
    return paths, meta


class _Run:
    """One training process's state: the drafter (and its teacher) on the target's device, the optimiser, the
    packs, where the schedule stands (step, epoch, position in the epoch's order), the clocks and the log."""

    def __init__(
        self,
        dist,
        target: Transformer,
        out: Path,
        cfg: TrainConfig,
        paths: list[Path],
        meta: dict[str, Any],
        init: str | None,
        resume: bool,
        progress: bool,
        online: OnlineChunks | None,
        max_minutes: float | None,
    ) -> None:
        from tqdm import tqdm

        self.dist, self.target, self.out, self.cfg, self.meta = dist, target, out, cfg, meta
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
        self.device = target.lm_head.weight.device
        torch.manual_seed(cfg.seed)
        ck_state = load_train_state(out) if resume else None
        self.drafter, teacher = make_drafter(target, cfg, init)
        if ck_state is not None:
            saved = load_drafter(out / "checkpoint", target).float()
            self.drafter.load_state_dict(saved.state_dict(), strict=False)
        unroll_ready(self.drafter)
        self.drafter.to(self.device)
        self.teacher = teacher.to(self.device) if teacher is not None else None
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        fused = self.device.type == "cuda"  # one kernel for the whole update on a GPU; the CPU keeps its reference path
        self.opt = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None
        )
        packs = plan_packs(meta["lengths"], cfg.pack_tokens)
        self.train_packs, self.held = split_packs(packs, len(meta["lengths"]), cfg.eval_packs)
        if not self.train_packs:
            raise SpecheadError("not enough data to train (every pack was held out)")
        per_epoch = len(self.train_packs) // self.world
        self.budget_s = max_minutes * 60 if max_minutes else None
        epochs_steps = max(1, int(math.ceil(per_epoch * cfg.epochs)))
        self.total = cfg.max_steps or (sys.maxsize if self.budget_s else epochs_steps)
        self.step, self.epoch, self.pos, spent_s = 0, 0, 0, 0.0
        if ck_state is not None:
            restore_optimizer(self.opt, ck_state["optimizer"], fused)
            self.step, self.epoch, self.pos = ck_state["step"], ck_state["epoch"], ck_state["pos"]
            spent_s = ck_state.get("elapsed_s", 0.0) if self.budget_s else 0.0  # a spent budget: nothing left to train
        out.mkdir(parents=True, exist_ok=True)
        self.log = (out / "train_log.jsonl").open("a") if self.rank == 0 else None
        self.cache = online if online is not None else ChunkCache(paths)
        self.bar = tqdm(
            total=None if self.total == sys.maxsize else self.total,
            initial=self.step,
            desc=f"train {cfg.arch}",
            disable=not progress or self.rank,
            dynamic_ncols=True,
        )
        self.t0, self.tokens_seen, self.ema = time.perf_counter(), 0, None
        self.clock0 = self.t0 - spent_s  # a timed run's clock, continued across resumes
        self.order = epoch_order(self.train_packs, cfg.seed, self.epoch)

    def spent(self) -> float | None:
        """The share of the time budget spent (None: an untimed run)."""
        return (time.perf_counter() - self.clock0) / self.budget_s if self.budget_s else None

    def checkpoint(self) -> None:
        state = {"step": self.step, "epoch": self.epoch, "pos": self.pos, "config": asdict(self.cfg)}
        save_checkpoint(self.out, self.drafter, self.opt, {**state, "elapsed_s": time.perf_counter() - self.clock0})

    def stop_for_time(self) -> None:
        """End the run at this step, finished: the total becomes the step, logged and checkpointed by rank 0."""
        self.total = self.step
        if self.rank == 0:
            stop = {"step": self.step, "stopped": "time budget spent", "elapsed_s": _elapsed(self.clock0)}
            self.log.write(json.dumps(stop) + "\n")
            self.checkpoint()

    def train_step(self, spent: float | None, end: int) -> None:
        """One optimiser step on this process's next pack (a new epoch's order when the order runs out), then the
        log, the held-out evaluation and the checkpoint where they are due."""
        cfg, world, rank = self.cfg, self.world, self.rank
        if self.pos + world > len(self.order):
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = epoch_order(self.train_packs, cfg.seed, self.epoch)
        c, lo, hi = self.order[self.pos + rank]
        self.pos += world
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.total, cfg, spent)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + self.step * world + rank)
        batch = make_batch(self.cache.get(c), lo, hi).to(self.device)
        res = run_ttt(self.drafter, self.target, batch, cfg, gen, self.teacher)
        self.opt.zero_grad(set_to_none=False)
        res.loss.backward()
        if self.dist:
            _all_reduce_grads(self.params, self.dist, world)
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
        self.opt.step()
        self.step += 1
        self.tokens_seen += res.tokens * world
        self._report(res, gnorm, spent)
        if cfg.eval_every and self.step % cfg.eval_every == 0 and rank == 0 and self.held:
            ev = evaluate(self.drafter, self.target, self.cache, self.held, cfg, self.teacher)
            self.log.write(json.dumps({"step": self.step, "eval": ev}) + "\n")
            self.log.flush()
        if rank == 0 and (self.step % cfg.save_every == 0 or self.step == end):
            self.checkpoint()

    def _report(self, res, gnorm: float, spent: float | None) -> None:
        """The progress bar every step; the log line every ``log_every`` steps and at the last."""
        loss = float(res.loss.detach())
        self.ema = loss if self.ema is None else 0.95 * self.ema + 0.05 * loss
        rate = self.tokens_seen / (time.perf_counter() - self.t0)
        acc = res.top1[0][0] / max(1, res.top1[0][1])
        self.bar.set_postfix(loss=f"{self.ema:.3f}", top1=f"{acc:.2f}", tok_s=f"{rate:.0f}")
        self.bar.update(1)
        if self.log and (self.step % self.cfg.log_every == 0 or self.step == self.total):
            rec = {"step": self.step, "epoch": self.epoch, "loss": loss, "loss_ema": self.ema, "ce": res.ce}
            rec.update(top1_0=acc, lr=lr_at(self.step - 1, self.total, self.cfg, spent), grad_norm=gnorm)
            rec.update(tokens_per_s=rate, elapsed_s=_elapsed(self.t0))
            self.log.write(json.dumps(rec) + "\n")
            self.log.flush()

    def finish(self) -> dict[str, Any]:
        """The final metrics; rank 0 evaluates on the held-out packs and writes the deployable drafter and
        metrics.json, every process its parameters' checksum when there are several."""
        rank, world = self.rank, self.world
        metrics: dict[str, Any] = {
            "steps": self.step,
            "epochs": self.step * world / max(1, len(self.train_packs)),
            "world": world,
        }
        metrics["param_checksum"] = param_checksum(self.drafter)
        if rank == 0:
            if self.held:
                metrics["eval"] = evaluate(self.drafter, self.target, self.cache, self.held, self.cfg, self.teacher)
            metrics["train_tokens_per_s"] = self.tokens_seen / max(1e-9, time.perf_counter() - self.t0)
            metrics["config"] = asdict(self.cfg)
            metrics["features"] = {k: self.meta.get(k) for k in ("tokens", "targets", "examples", "chunks", "data")}
            self.drafter.save(self.out)  # the deployable bf16 drafter
            (self.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
            self.log.close()
        if self.dist:
            checksum = json.dumps({"param_checksum": metrics["param_checksum"]})
            (self.out / f"checksum_rank{rank}.json").write_text(checksum)
            self.dist.barrier()
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
