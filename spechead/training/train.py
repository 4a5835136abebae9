"""Drafter training: EAGLE-1/2 and EAGLE-3 objectives over cached target features, SlimSpec heads.

Both architectures train with one loop, the *training-time test* (TTT) unroll of EAGLE-3: step 0
feeds the cached target feature f_t and token x_{t+1} at position t and predicts x_{t+2}; step i
feeds the drafter's own step-(i-1) output and x_{t+1+i} at position t+i, attending to the real
prefix (step-0 keys up to t) plus its own chain (the diagonal keys of steps 1..i), exactly what
tree drafting shows it at inference. Losses:

* EAGLE-1/2 (``--arch eagle2``, default 1 step): SmoothL1 regression of the predicted feature on
  f_{t+1+i} plus ``ce_weight`` x soft cross-entropy of the target's head on it against the
  target's own distribution (computed from the cached f through the frozen head).
* EAGLE-3 (``--arch eagle3``, default 7 steps): soft cross-entropy against the target's
  distribution at each step, weighted 0.8^i.

The vocabulary-wide cross-entropy dominates the cost (V = 49152 on the demo target against a
576-wide drafter), so it is computed on ``ce_positions`` random valid positions per step; the
regression term is cheap and uses every position. Everything is seeded per step, so a resumed
run retraces the uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.model.drafter import Drafter, Eagle3Drafter, load_drafter, random_drafter
from spechead.model.layers import Rotary, apply_rope
from spechead.model.transformer import Transformer
from spechead.training.features import Chunk, block_causal_mask, feature_chunks, load_chunk, packed_positions


# -- configuration ----------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    arch: str = "eagle2"
    head: str = "full"  # full | lowrank:R
    lowrank_init: str = "svd"  # svd | random
    steps_ttt: int = 0  # 0 = architecture default (1 for eagle2, 7 for eagle3)
    step_decay: float = 0.8
    epochs: float = 1.0
    max_steps: int = 0  # 0 = from epochs
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 50
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    pack_tokens: int = 1024
    ce_positions: int = 256
    ce_weight: float = 0.1  # EAGLE-1/2 p_w (regression weight v_w = 1)
    noise: float = 0.0  # uniform feature noise (EAGLE-1 trick), relative to the feature RMS
    topk: int = 4
    eval_every: int = 0
    eval_packs: int = 16
    eval_positions: int = 256  # sampled (seeded) per pack and step: the V-wide head makes every position costly
    save_every: int = 200
    log_every: int = 10
    seed: int = 0
    freeze_backbone: bool = False  # post-hoc SlimSpec: only the head trains, distilled from a teacher head
    all_positions: bool = False  # also train on non-assistant positions (labels are the target's anyway)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_steps(self) -> int:
        return self.steps_ttt or (1 if self.arch == "eagle2" else 7)

    @property
    def rank(self) -> int | None:
        name, _, arg = self.head.partition(":")
        if name == "full":
            return None
        if name != "lowrank":
            raise SpecheadError(f"unknown training head {self.head!r}; expected full or lowrank:R")
        try:
            return int(arg) if arg else -1
        except ValueError:
            raise SpecheadError(f"lowrank head wants an integer rank (lowrank:R), got {arg!r}") from None


# -- drafter construction ----------------------------------------------------------------------------
def make_drafter(target: Transformer, cfg: TrainConfig, init: str | None = None) -> tuple[Drafter, Tensor | None]:
    """A float32 drafter to train, and the teacher head weight for post-hoc low-rank distillation.

    ``init`` continues from a drafter folder; a ``lowrank:R`` head then replaces its full head,
    initialised from the SVD of that head (or randomly), and the old head becomes the teacher.
    """
    from spechead.model.lowrank import LowRankLinear, check_rank, default_rank

    if cfg.arch not in ("eagle2", "eagle3"):
        raise SpecheadError(f"unknown drafter architecture {cfg.arch!r}; expected eagle2 or eagle3")
    rank = cfg.rank
    d, V = target.config.hidden_size, target.config.vocab_size
    if rank is not None:
        if cfg.arch != "eagle3":
            raise SpecheadError("a low-rank head needs --arch eagle3 (EAGLE-1/2 drafters use the target's head)")
        rank = default_rank(d) if rank < 0 else rank
        check_rank(rank, d)
    target.requires_grad_(False)
    if init:
        drafter = load_drafter(init, target)
        if drafter.arch != cfg.arch:
            raise SpecheadError(f"--init drafter is {drafter.arch}, not {cfg.arch}")
    else:
        kw = {"tie_lm_head_to_target": True} if cfg.arch == "eagle3" else {}
        drafter = random_drafter(target, cfg.arch, cfg.seed, **kw)
    drafter = drafter.float().train()
    teacher = None
    if rank is not None and not (isinstance(drafter, Eagle3Drafter) and drafter.low_rank_head is not None):
        full, row_ids = drafter.head_weight(target)
        if row_ids is not None:
            raise SpecheadError("low-rank training over a reduced draft vocabulary is not supported")
        full = full.detach().float()
        if cfg.lowrank_init == "svd":
            head = LowRankLinear.from_svd(full, rank)
        elif cfg.lowrank_init == "random":
            gen = torch.Generator().manual_seed(cfg.seed + 1)
            head = LowRankLinear.from_random(d, V, rank, generator=gen)
        else:
            raise SpecheadError(f"unknown --lowrank-init {cfg.lowrank_init!r}; expected svd or random")
        drafter.tied_head = False
        drafter._tied = []
        drafter.lm_head = head.float()
        drafter.config.extra["lm_head_rank"] = rank
        teacher = full if init else None
    if cfg.freeze_backbone:
        if not init or rank is None:
            raise SpecheadError("--freeze-backbone is the post-hoc low-rank route: it needs --init and --head lowrank")
        drafter.requires_grad_(False)
        drafter.lm_head.requires_grad_(True)
    return drafter, teacher


def draft_logits(drafter: Drafter, target: Transformer, x: Tensor) -> Tensor:
    """Logits of the drafter's head over the target vocabulary for head inputs x [n, d]."""
    lr = drafter.low_rank_head if isinstance(drafter, Eagle3Drafter) else None
    if lr is not None:
        return lr(x)
    w, row_ids = drafter.head_weight(target)
    if row_ids is not None:
        raise SpecheadError("training a drafter with a reduced draft vocabulary is not supported")
    return x @ w.T.to(x.dtype)


# -- the training-time-test unroll ---------------------------------------------------------------------
def _ttt_attention(attn, x: Tensor, cos: Tensor, sin: Tensor, mask0: Tensor, past: list[tuple[Tensor, Tensor]]):
    """Attention of step i = len(past): step-0 keys under ``mask0`` plus the diagonal keys of steps 1..i."""
    t, hd = x.shape[0], attn.head_dim
    q = attn.q_proj(x).view(t, attn.n_heads, hd).transpose(0, 1)
    k = attn.k_proj(x).view(t, attn.n_kv, hd).transpose(0, 1)
    v = attn.v_proj(x).view(t, attn.n_kv, hd).transpose(0, 1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    past.append((k, v))
    rep = attn.n_heads // attn.n_kv
    if len(past) == 1:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask0, enable_gqa=rep > 1)[0]
    else:
        scale = hd**-0.5
        k0, v0 = (z.repeat_interleave(rep, 0) for z in past[0])
        s0 = (q @ k0.transpose(1, 2) * scale).masked_fill(~mask0, float("-inf"))  # [H, T, T]
        ks = torch.stack([z[0].repeat_interleave(rep, 0) for z in past[1:]], dim=2)  # [H, T, i, hd]
        vs = torch.stack([z[1].repeat_interleave(rep, 0) for z in past[1:]], dim=2)
        sd = (q[:, :, None] * ks).sum(-1) * scale  # [H, T, i]
        p = torch.softmax(torch.cat([s0, sd], dim=-1), dim=-1)
        out = p[..., :t] @ v0 + (p[..., t:, None] * vs).sum(2)
    return attn.o_proj(out.transpose(0, 1).reshape(t, -1))


def _layer_input(drafter: Drafter, tokens: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """(residual, attention input) for a drafter step, as in the drafter's own forward."""
    if isinstance(drafter, Eagle3Drafter):
        if h.shape[-1] != drafter.config.hidden_size:
            h = drafter.fc(h)
        layer = drafter.midlayer
        return h, torch.cat([layer.input_layernorm(drafter.embed(tokens)), layer.hidden_norm(h)], dim=-1)
    x = drafter.fc(torch.cat([drafter.embed(tokens), h], dim=-1))
    return x, x


@dataclass
class Batch:
    """A pack of examples: per token ids, loss mask, example end (exclusive), features."""

    ids: Tensor
    mask: Tensor
    end: Tensor
    lengths: list[int]
    hidden: Tensor
    aux: Tensor | None


def make_batch(chunk: Chunk, lo: int, hi: int) -> Batch:
    sl = slice(int(chunk.starts[lo]), int(chunk.starts[hi]))
    starts = chunk.starts[lo : hi + 1] - chunk.starts[lo]
    lengths = (starts[1:] - starts[:-1]).tolist()
    end = torch.repeat_interleave(starts[1:], torch.tensor(lengths))
    aux = chunk.aux[sl] if chunk.aux is not None else None
    return Batch(chunk.ids[sl], chunk.mask[sl], end, lengths, chunk.hidden[sl], aux)


@dataclass
class StepOut:
    loss: Tensor
    ce: list[float]
    top1: list[tuple[int, int]]  # (agreements, positions) per step
    topk: list[tuple[int, int]]
    tokens: int


def run_ttt(
    drafter: Drafter,
    target: Transformer,
    b: Batch,
    cfg: TrainConfig,
    gen: torch.Generator,
    teacher: Tensor | None = None,
    ce_positions: int | None = None,
    states: list[Tensor] | None = None,
) -> StepOut:
    """The loss of one pack, unrolled over ``cfg.n_steps`` steps (see the module docstring)."""
    n = b.ids.numel()
    idx = torch.arange(n)
    mask0 = block_causal_mask(b.lengths)
    pos0 = packed_positions(b.lengths)
    hidden = b.hidden.float()
    w_t = target.lm_head.weight
    eagle3 = isinstance(drafter, Eagle3Drafter)
    if eagle3:
        if b.aux is None:
            raise SpecheadError("these features have no EAGLE-3 layer states; extract them with --arch eagle3")
        h = b.aux.float()
    else:
        h = hidden
        if cfg.noise > 0 and drafter.training:
            rms = h.pow(2).mean(-1, keepdim=True).sqrt()
            h = h + (torch.rand(h.shape, generator=gen) * 2 - 1) * cfg.noise * rms
    layer, past = drafter.layer, []
    total = torch.zeros(())
    ce_log, top1, topk = [], [], []
    n_ce = ce_positions or cfg.ce_positions
    frozen = cfg.freeze_backbone
    for i in range(cfg.n_steps):
        src = idx + 1 + i  # input token index
        tgt = idx + 2 + i  # predicted token index
        tok = b.ids[src.clamp_max(n - 1)]
        valid = (tgt < b.end) & (b.mask[tgt.clamp_max(n - 1)] | (cfg.all_positions and drafter.training))
        cos, sin = drafter.rotary(pos0 + i)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            resid, x = _layer_input(drafter, tok, h)
            out = resid + _ttt_attention(layer.self_attn, x, cos, sin, mask0, past)
            out = out + layer.mlp(layer.post_attention_layernorm(out))
        if states is not None:
            states.append(out)
        rows = valid.nonzero().flatten()
        weight = cfg.step_decay**i
        if rows.numel():
            if not eagle3:  # feature regression on every valid position
                reg = F.smooth_l1_loss(out[rows], hidden[src[rows]])
                total = total + weight * reg
            pick = rows[torch.randperm(rows.numel(), generator=gen)[:n_ce]]
            head_in = drafter.head_input(out[pick])
            logits = draft_logits(drafter, target, head_in).float()
            with torch.no_grad():
                feat_next = hidden[src[pick]]
                t_logits = (drafter.head_input(out[pick]) @ teacher.T) if teacher is not None else feat_next @ w_t.T
                p = torch.softmax(t_logits.float(), -1)
            ce = -(p * torch.log_softmax(logits, -1)).sum(-1).mean()
            total = total + weight * (cfg.ce_weight if not eagle3 and teacher is None else 1.0) * ce
            with torch.no_grad():
                ref = p.argmax(-1)
                top1.append((int((logits.argmax(-1) == ref).sum()), int(pick.numel())))
                kk = logits.topk(min(cfg.topk, logits.shape[-1]), -1).indices
                topk.append((int((kk == ref[:, None]).any(-1).sum()), int(pick.numel())))
                ce_log.append(float(ce))
        else:
            top1.append((0, 0))
            topk.append((0, 0))
            ce_log.append(float("nan"))
        h = out
    return StepOut(total, ce_log, top1, topk, n)


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


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` x lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class ChunkCache:
    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.idx, self.chunk = paths, -1, None

    def get(self, c: int) -> Chunk:
        if c != self.idx:
            self.chunk, self.idx = load_chunk(self.paths[c]), c
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
        b = make_batch(cache.get(c), lo, hi)
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


def param_checksum(drafter: Drafter) -> float:
    return float(sum(p.detach().double().sum() for p in drafter.parameters() if p.requires_grad))


# -- the loop ---------------------------------------------------------------------------------------
def train(
    target: Transformer,
    features: Path,
    out: Path,
    cfg: TrainConfig,
    init: str | None = None,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train a drafter on cached features; returns the final metrics (also written to metrics.json).

    ``stop_after`` ends this call after that many steps (checkpointed) without changing the schedule,
    so a long run can be done in slots; rerunning resumes from the checkpoint.
    """
    from tqdm import tqdm

    dist = _distributed()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    paths = feature_chunks(features)
    meta = json.loads((features / "meta.json").read_text())
    # An extraction still running (or stopped early) leaves chunks 0..n-1: train on those.
    n_ready = next((i for i, p in enumerate(paths) if p.name != f"chunk_{i:05d}.pt"), len(paths))
    paths = paths[:n_ready]
    meta["lengths"] = meta["lengths"][:n_ready]
    if meta.get("hidden_size") != target.config.hidden_size or meta.get("vocab_size") != target.config.vocab_size:
        raise SpecheadError(f"features in {features} were extracted from another target")
    torch.manual_seed(cfg.seed)
    ck_state = load_train_state(out) if resume else None
    drafter, teacher = make_drafter(target, cfg, init)
    if ck_state is not None:
        saved = load_drafter(out / "checkpoint", target).float()
        drafter.load_state_dict(saved.state_dict(), strict=False)
    drafter.rotary = Rotary(drafter.config.head_dim, 8192, drafter.config.rope_theta, drafter.config.rope_scaling)
    drafter.layer.self_attn.cache = None
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    packs = plan_packs(meta["lengths"], cfg.pack_tokens)
    train_packs, held = split_packs(packs, len(paths), cfg.eval_packs)
    if not train_packs:
        raise SpecheadError("not enough data to train (every pack was held out)")
    per_epoch = len(train_packs) // world
    total = cfg.max_steps or max(1, int(math.ceil(per_epoch * cfg.epochs)))
    step, epoch, pos = 0, 0, 0
    if ck_state is not None:
        opt.load_state_dict(ck_state["optimizer"])
        step, epoch, pos = ck_state["step"], ck_state["epoch"], ck_state["pos"]
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "train_log.jsonl").open("a") if rank == 0 else None
    cache = ChunkCache(paths)
    bar = tqdm(total=total, initial=step, desc=f"train {cfg.arch}", disable=not progress or rank, dynamic_ncols=True)
    t0, tokens_seen, ema = time.perf_counter(), 0, None
    order = epoch_order(train_packs, cfg.seed, epoch)
    end = total if stop_after is None else min(total, step + stop_after)
    while step < end:
        if pos + world > len(order):
            epoch, pos = epoch + 1, 0
            order = epoch_order(train_packs, cfg.seed, epoch)
        c, lo, hi = order[pos + rank]
        pos += world
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, cfg)
        gen = torch.Generator().manual_seed(cfg.seed * 7919 + step * world + rank)
        res = run_ttt(drafter, target, make_batch(cache.get(c), lo, hi), cfg, gen, teacher)
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
            rec.update(lr=lr_at(step - 1, total, cfg), grad_norm=gnorm, tokens_per_s=rate, elapsed_s=_elapsed(t0))
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if cfg.eval_every and step % cfg.eval_every == 0 and rank == 0 and held:
            ev = evaluate(drafter, target, cache, held, cfg, teacher)
            log.write(json.dumps({"step": step, "eval": ev}) + "\n")
            log.flush()
        if rank == 0 and (step % cfg.save_every == 0 or step == end):
            save_checkpoint(out, drafter, opt, {"step": step, "epoch": epoch, "pos": pos, "config": asdict(cfg)})
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


# -- CLI --------------------------------------------------------------------------------------------
def _examples(target_folder: Path, data: list[str], max_len: int, seed: int):
    from spechead.model.tokenizer import load_tokenizer
    from spechead.training.data import load_examples

    return load_examples(load_tokenizer(target_folder), data, max_len=max_len, seed=seed)


def extract_to(
    target: str,
    data: list[str],
    features: Path,
    arch: str,
    max_len: int,
    seed: int,
    chunk_tokens: int,
    shard: tuple[int, int] = (0, 1),
):
    from spechead.model.loading import load_target
    from spechead.training.features import extract_features

    model, folder = load_target(target)
    ctx = model.config.max_position_embeddings
    max_len = min(max_len, ctx)
    pack_tokens = min(max(2048, max_len), ctx)
    examples = _examples(folder, data, max_len, seed)
    model.setup_cache(pack_tokens)
    meta = {"data": data, "max_len": max_len, "seed": seed, "target": target}
    extract_features(model, examples, features, arch == "eagle3", chunk_tokens, pack_tokens, meta=meta, shard=shard)
    return model


def cmd_extract(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        i, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise SpecheadError(f"--shard wants I/N with 0 <= I < N, got {args.shard!r}") from None
    if not args.data:
        raise SpecheadError("extract needs --data FILES")
    extract_to(
        args.target, args.data, Path(args.features), args.arch, args.max_len, args.seed, args.chunk_tokens, (i, n)
    )
    print(f"features in {args.features}")
    return 0


def cmd_train(args) -> int:
    from spechead.model.loading import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    features = Path(args.features) if args.features else out / "features"
    cfg = TrainConfig(
        arch=args.arch,
        head=args.head,
        lowrank_init=args.lowrank_init,
        steps_ttt=args.ttt_steps,
        epochs=args.epochs,
        max_steps=args.max_steps,
        lr=args.lr,
        warmup=args.warmup,
        grad_clip=args.grad_clip,
        pack_tokens=args.pack_tokens,
        ce_positions=args.ce_positions,
        ce_weight=args.ce_weight,
        noise=args.noise,
        eval_every=args.eval_every,
        eval_packs=args.eval_packs,
        save_every=args.save_every,
        seed=args.seed,
        freeze_backbone=args.freeze_backbone,
        all_positions=args.loss_on == "all",
    )
    cfg.rank  # validate the head spec before any work  # noqa: B018
    if args.data:
        model = extract_to(args.target, args.data, features, args.arch, args.max_len, args.seed, args.chunk_tokens)
    elif not (features / "meta.json").is_file():
        raise SpecheadError(f"no features in {features}: pass --data FILES or --features DIR")
    else:
        model, _ = load_target(args.target)
    metrics = train(model, features, out, cfg, args.init, not args.no_resume, not args.quiet, args.stop_after)
    if int(os.environ.get("RANK", "0")):
        return 0
    if metrics["steps"] < metrics.get("total_steps", metrics["steps"]):
        print(f"stopped after step {metrics['steps']} of {metrics['total_steps']}; rerun to resume")
        return 0
    if "eval" in metrics:
        ev = metrics["eval"]
        top1 = " ".join(f"{a:.3f}" for a in ev["top1"])
        print(f"held-out top-1 agreement per step: {top1} ({ev['positions']} positions)")
    print(f"drafter saved to {out}")
    return 0


def add_cli(sub) -> None:
    g = sub.add_parser("gen-data", help="regenerate assistant replies with the target (self-distillation data)")
    g.add_argument("--target", default="demo")
    g.add_argument("--data", nargs="+", required=True, help="chat JSONL files (FILE or FILE:N)")
    g.add_argument("--out", required=True, help="output JSONL (appended to; rerun to resume)")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights to generate with")
    g.add_argument("--stop-after", type=int, default=None, help="stop this call after N prompts (resume later)")
    g.set_defaults(func=cmd_gen_data)

    def common(p) -> None:
        p.add_argument("--target", default="demo")
        p.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"])
        p.add_argument("--data", nargs="+", default=None, help="chat / text JSONL files (FILE or FILE:N)")
        p.add_argument("--max-len", type=int, default=1024)
        p.add_argument("--chunk-tokens", type=int, default=65536)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--threads", type=int, default=None)

    e = sub.add_parser("extract", help="cache the target features drafters train on")
    common(e)
    e.add_argument("--features", required=True)
    e.add_argument("--shard", default="0/1", help="I/N: extract every N-th chunk starting at I (parallel workers)")
    e.set_defaults(func=cmd_extract)

    t = sub.add_parser("train-drafter", help="train an EAGLE-2 / EAGLE-3 drafter (optionally a SlimSpec head)")
    common(t)
    t.add_argument("--out", required=True)
    t.add_argument("--features", default=None, help="feature folder (default OUT/features)")
    t.add_argument("--head", default="full", help="full | lowrank:R")
    t.add_argument("--lowrank-init", default="svd", choices=["svd", "random"])
    t.add_argument("--init", default=None, help="start from this drafter folder")
    t.add_argument("--freeze-backbone", action="store_true", help="post-hoc low-rank head: distil from --init's head")
    t.add_argument("--ttt-steps", type=int, default=0, help="unrolled steps (default 1 eagle2, 7 eagle3)")
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument("--max-steps", type=int, default=0)
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--pack-tokens", type=int, default=1024)
    t.add_argument("--ce-positions", type=int, default=256)
    t.add_argument("--ce-weight", type=float, default=0.1)
    t.add_argument("--noise", type=float, default=0.0)
    t.add_argument(
        "--loss-on",
        default="assistant",
        choices=["assistant", "all"],
        help="positions to train on (held-out metrics always use assistant tokens)",
    )
    t.add_argument("--eval-every", type=int, default=0)
    t.add_argument("--eval-packs", type=int, default=16)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--no-resume", action="store_true")
    t.add_argument("--stop-after", type=int, default=None, help="stop this call after N steps (resume later)")
    t.add_argument("--quiet", action="store_true")
    t.set_defaults(func=cmd_train)


def cmd_gen_data(args) -> int:
    from spechead.training.data import generate_data

    n = generate_data(
        args.target,
        args.data,
        Path(args.out),
        args.batch_size,
        args.max_new_tokens,
        args.max_prompt_tokens,
        args.temperature,
        args.seed,
        args.threads,
        args.stop_after,
        args.dtype,
    )
    print(f"wrote {n} records to {args.out}")
    return 0
