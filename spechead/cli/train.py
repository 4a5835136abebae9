"""``spechead gen-data | extract | train-drafter``: the command line of drafter training (:mod:`spechead.training`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from spechead.cli.args import add_target, add_threads, positive_int, set_threads
from spechead.errors import SpecheadError
from spechead.model.loading import load_target
from spechead.training.config import TrainConfig
from spechead.training.data import GEN_ENGINES, generate_data
from spechead.training.extract import extract_to, online_features
from spechead.training.loop import train


def cmd_gen_data(args) -> int:
    checked_device(args.device)
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
        args.engine,
        args.device,
    )
    print(f"wrote {n} records to {args.out}")
    return 0


def cmd_extract(args) -> int:
    set_threads(args.threads)
    try:
        i, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= i < n:
            raise ValueError
    except ValueError:
        raise SpecheadError(f"--shard wants I/N with 0 <= I < N, got {args.shard!r}") from None
    if not args.data:
        raise SpecheadError("extract needs --data FILES")
    if args.pack_tokens is not None and args.pack_tokens < args.max_len:
        raise SpecheadError(f"--pack-tokens must be at least --max-len ({args.max_len}), got {args.pack_tokens}")
    extract_to(
        args.target,
        args.data,
        Path(args.features),
        args.arch,
        args.max_len,
        args.seed,
        args.chunk_tokens,
        (i, n),
        args.pack_tokens,
        args.dtype,
        accelerator(args.device),
    )
    print(f"features in {args.features}")
    return 0


def train_config(args) -> TrainConfig:
    """The run's settings from ``train-drafter``'s options (the rest keep TrainConfig's defaults)."""
    return TrainConfig(
        arch=args.arch,
        head=args.head,
        lowrank_init=args.lowrank_init,
        lowrank_teacher=args.lowrank_teacher,
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


def cmd_fit_lowrank(args) -> int:
    import json

    from spechead.training.lowrank_fit import fit_low_rank_head

    set_threads(args.threads)
    target, _ = load_target(args.target)
    report = fit_low_rank_head(
        target, Path(args.drafter), Path(args.features), args.rank, args.fit_tokens, args.eval_tokens
    )
    print(json.dumps(report, indent=2))
    return 0


def cmd_train(args) -> int:
    set_threads(args.threads)
    out = Path(args.out)
    features = Path(args.features) if args.features else out / "features"
    cfg = train_config(args)
    cfg.rank  # validate the head spec before any work  # noqa: B018
    if (out / "model.safetensors").exists() and not (out / "checkpoint").is_dir():  # a drafter, not a run
        raise SpecheadError(f"{out} already holds a drafter and no training run to resume; choose another --out")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise SpecheadError(f"--max-minutes must be > 0, got {args.max_minutes}")
    device = accelerator(args.device)
    online = None
    if args.online:
        if not args.data:
            raise SpecheadError("--online computes the features from --data FILES; pass them")
        if args.features:
            raise SpecheadError("--online computes the features as it trains; --features names a cached folder")
        online = online_features(args.target, args.data, args.arch, args.max_len, args.seed, args.chunk_tokens, device)
        model = online.target
    elif args.data:
        model = extract_to(
            args.target, args.data, features, args.arch, args.max_len, args.seed, args.chunk_tokens, device=device
        )
        model = model.to(device)
    elif not (features / "meta.json").is_file():
        raise SpecheadError(f"no features in {features}: pass --data FILES or --features DIR")
    else:
        model, _ = load_target(args.target, device=device)
    metrics = train(
        model,
        features,
        out,
        cfg,
        args.init,
        not args.no_resume,
        not args.quiet,
        args.stop_after,
        online,
        args.max_minutes,
    )
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


def checked_device(name: str) -> torch.device:
    """``--device``: cpu, or a CUDA device torch can see."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SpecheadError(f"--device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpecheadError("--device cuda: no CUDA device is visible to torch")
    if device.type not in ("cpu", "cuda"):
        raise SpecheadError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    return device


def accelerator(name: str) -> torch.device:
    """The device to train on; on a GPU float32 matrix products use its TF32 units (the target's states and the
    drafter's gradients in training only: generation and decoding keep full float32)."""
    device = checked_device(name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] to generate / train on a GPU")


def _features_options(p: argparse.ArgumentParser) -> None:
    """What ``extract`` and ``train-drafter`` share: the target, the drafter kind and how the data is cut."""
    add_target(p, precision=False)
    p.add_argument("--arch", default="eagle2", choices=["eagle2", "eagle3"])
    p.add_argument("--data", nargs="+", default=None, help="chat / text JSONL files (FILE or FILE:N)")
    p.add_argument("--max-len", type=positive_int, default=1024)
    p.add_argument("--chunk-tokens", type=positive_int, default=65536)
    p.add_argument("--seed", type=int, default=0)
    add_threads(p)


def add_cli(sub: argparse._SubParsersAction) -> None:
    """The training subcommands: gen-data, extract, train-drafter, fit-lowrank."""
    _add_gen_data(sub)
    _add_extract(sub)
    _add_train_drafter(sub)
    _add_fit_lowrank(sub)


def _add_gen_data(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("gen-data", help="regenerate assistant replies with the target (self-distillation data)")
    add_target(g, precision=False)
    g.add_argument("--data", nargs="+", required=True, help="chat JSONL files (FILE or FILE:N)")
    g.add_argument("--out", required=True, help="output JSONL (appended to; rerun to resume)")
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    add_threads(g)
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weights to generate with")
    g.add_argument(
        "--stop-after", type=positive_int, default=None, help="stop this call after N prompts (resume later)"
    )
    g.add_argument(
        "--engine",
        choices=GEN_ENGINES,
        default="spechead",
        help="spechead: the batched decoder (continuous batching; greedy replies are the target's own, token for "
        "token); transformers: static batches of generate",
    )
    _add_device(g)
    g.set_defaults(func=cmd_gen_data)


def _add_extract(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("extract", help="cache the target features drafters train on")
    _features_options(e)
    e.add_argument("--features", required=True)
    e.add_argument("--shard", default="0/1", help="I/N: extract every N-th chunk starting at I (parallel workers)")
    e.add_argument(
        "--pack-tokens",
        type=positive_int,
        default=None,
        help="tokens per target forward, at least --max-len (default max(2048, --max-len)); attention costs its square",
    )
    e.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the target's weights while extracting (features are stored in bf16 either way)",
    )
    _add_device(e)
    e.set_defaults(func=cmd_extract)


def _add_train_drafter(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train-drafter", help="train an EAGLE-2 / EAGLE-3 drafter (optionally a SlimSpec head)")
    _features_options(t)
    t.add_argument("--out", required=True)
    t.add_argument("--features", default=None, help="feature folder (default OUT/features)")
    t.add_argument("--head", default="full", help="full | lowrank:R")
    t.add_argument("--lowrank-init", default="svd", choices=["svd", "random"])
    t.add_argument(
        "--lowrank-teacher",
        default="head",
        choices=["head", "target"],
        help="with --init and a low-rank head: learn the init's full head on the drafter's states (head), or the "
        "target's next-token distribution with the backbone, the SlimSpec way (target)",
    )
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
    t.add_argument("--stop-after", type=positive_int, default=None, help="stop this call after N steps (resume later)")
    t.add_argument("--quiet", action="store_true")
    _add_device(t)
    t.add_argument(
        "--online",
        action="store_true",
        help="compute the target's states from --data as training needs them, never cached (for a GPU)",
    )
    t.add_argument(
        "--max-minutes", type=float, default=None, help="train for this long: the learning rate decays over the time"
    )
    t.set_defaults(func=cmd_train)


def _add_fit_lowrank(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fit-lowrank", help="fit an EAGLE-2 drafter's low-rank head to its own states (no training)")
    f.add_argument("--drafter", required=True, help="the EAGLE-2 drafter folder; lowrank_head.safetensors goes in it")
    f.add_argument("--features", required=True, help="feature folder the drafter runs over (held-out first)")
    f.add_argument("--rank", type=positive_int, default=None, help="rank (default d/8)")
    f.add_argument("--fit-tokens", type=positive_int, default=65536)
    f.add_argument("--eval-tokens", type=positive_int, default=2048)
    add_target(f, precision=False)
    add_threads(f)
    f.set_defaults(func=cmd_fit_lowrank)
