"""What a training run trains: its settings (``TrainConfig``) and the float32 drafter they describe
(``make_drafter``: a fresh or continued drafter, optionally with a SlimSpec low-rank head and its teacher)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.model.drafter import Drafter, Eagle3Drafter, load_drafter, random_drafter
from spechead.model.transformer import Transformer


@dataclass
class TrainConfig:
    arch: str = "eagle2"
    head: str = "full"  # full | lowrank:R
    lowrank_init: str = "svd"  # svd | random
    lowrank_teacher: str = "head"  # with --init: distil the init's full head (head) or the target's distribution
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

    def __post_init__(self) -> None:
        """Refuse settings no run can use before anything loads (``train-drafter`` builds this first)."""
        if self.arch not in ("eagle2", "eagle3"):
            raise SpecheadError(f"unknown --arch {self.arch!r}; expected eagle2 or eagle3")
        checks = [
            ("--ttt-steps", self.steps_ttt, self.steps_ttt >= 0, ">= 0 (0: the architecture's default)"),
            ("--epochs", self.epochs, self.epochs > 0, "> 0"),
            ("--max-steps", self.max_steps, self.max_steps >= 0, ">= 0 (0: from --epochs)"),
            ("--lr", self.lr, self.lr > 0, "> 0"),
            ("--warmup", self.warmup, self.warmup >= 0, ">= 0"),
            ("--grad-clip", self.grad_clip, self.grad_clip > 0, "> 0"),
            ("--pack-tokens", self.pack_tokens, self.pack_tokens >= 2, ">= 2"),
            ("--ce-positions", self.ce_positions, self.ce_positions >= 1, ">= 1"),
            ("--ce-weight", self.ce_weight, self.ce_weight >= 0, ">= 0"),
            ("--noise", self.noise, self.noise >= 0, ">= 0"),
            ("--eval-every", self.eval_every, self.eval_every >= 0, ">= 0 (0: only at the end)"),
            ("--eval-packs", self.eval_packs, self.eval_packs >= 1, ">= 1"),
            ("--save-every", self.save_every, self.save_every >= 1, ">= 1"),
        ]
        for flag, value, ok, want in checks:
            if not ok:  # (a NaN fails every comparison, so it is refused too)
                raise SpecheadError(f"{flag} must be {want}, got {value}")

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
        if hasattr(drafter, "detach_low_rank_head"):
            drafter.detach_low_rank_head()  # fitted to the weights training is about to change
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
        if cfg.lowrank_teacher not in ("head", "target"):
            raise SpecheadError(f"unknown --lowrank-teacher {cfg.lowrank_teacher!r}; expected head or target")
        teacher = full if init and cfg.lowrank_teacher == "head" else None
    if cfg.freeze_backbone:
        if not init or rank is None:
            raise SpecheadError("--freeze-backbone is the post-hoc low-rank route: it needs --init and --head lowrank")
        drafter.requires_grad_(False)
        drafter.lm_head.requires_grad_(True)
    return drafter, teacher
