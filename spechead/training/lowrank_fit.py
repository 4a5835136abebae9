"""Fit an EAGLE-2 drafter's low-rank head to the states it produces (SlimSpec without storing W_up).

The drafter runs teacher-forced over cached target features; the second moment E[h h^T] of its head inputs
decides the rank-r factors (``model.lowrank.whitened_factors``: the best rank-r head for those states, an
up-projection in the column space of the target's head, so only two [d, r] matrices are stored). Held-out
states report how often the low-rank head's top-1 is the full head's, for these factors and for the plain
SVD of the same rank (the state-blind baseline).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from spechead.errors import SpecheadError
from spechead.model.drafter import Eagle2Drafter, load_drafter
from spechead.model.lowrank import check_rank, default_rank, svd_factors, whitened_factors
from spechead.model.transformer import Transformer
from spechead.training.features import feature_chunks, load_chunk


@torch.inference_mode()
def drafter_states(drafter: Eagle2Drafter, features: Path, max_tokens: int, max_len: int = 2048) -> Tensor:
    """Head inputs [N, d] of the drafter, teacher-forced on the cached examples (pairs feature_j, token_j+1)."""
    drafter.setup_cache(max_len)
    out: list[Tensor] = []
    n = 0
    paths = feature_chunks(features)
    if not paths:
        raise SpecheadError(f"no feature chunks in {features}")
    bar = tqdm(total=max_tokens, desc="drafter states", unit="tok", dynamic_ncols=True)
    for path in paths:
        chunk = load_chunk(path)
        for i in range(chunk.n_examples):
            sl = chunk.example(i)
            ids, hidden = chunk.ids[sl][: max_len + 1], chunk.hidden[sl][: max_len + 1]
            if ids.numel() < 2:
                continue
            t = ids.numel() - 1
            h = drafter(ids[1:], hidden[:-1].float(), 0, torch.arange(t), None)
            out.append(drafter.head_input(h).float())
            n += t
            bar.update(t)
            if n >= max_tokens:
                bar.close()
                return torch.cat(out)[:max_tokens]
    bar.close()
    return torch.cat(out)


def argmax_rows(states: Tensor, head, batch: int = 256) -> Tensor:
    """argmax of ``head(h)`` for every state, ``batch`` states at a time (a [batch, V] block of logits)."""
    return torch.cat([head(states[i : i + batch]).argmax(-1) for i in range(0, states.shape[0], batch)])


def top1_agreement(ref: Tensor, up: Tensor, down: Tensor, states: Tensor) -> float:
    """How often argmax of the low-rank logits equals ``ref``, the full head's argmax over ``states``."""
    mine = argmax_rows(states, lambda h: (h @ down.T) @ up.T)
    return float((mine == ref).float().mean()) if ref.numel() else 0.0


def fit_low_rank_head(
    target: Transformer,
    drafter_dir: Path,
    features: Path,
    rank: int | None = None,
    fit_tokens: int = 65536,
    eval_tokens: int = 2048,
) -> dict[str, Any]:
    """Fit, write ``drafter_dir/lowrank_head.safetensors`` and return what was measured (also written beside it)."""
    drafter = load_drafter(drafter_dir, target)
    if not isinstance(drafter, Eagle2Drafter):
        raise SpecheadError("a fitted low-rank head is for an EAGLE-2 drafter (EAGLE-3 trains its own: --head lowrank)")
    w = target.lm_head.weight.detach().float()
    d = w.shape[1]
    r = default_rank(d) if rank is None else rank
    check_rank(r, d)
    states = drafter_states(drafter, features, fit_tokens + eval_tokens)
    if states.shape[0] <= eval_tokens:
        raise SpecheadError(f"only {states.shape[0]} drafter states in {features}; need more than {eval_tokens}")
    held, fit = states[:eval_tokens], states[eval_tokens:]
    if fit.shape[0] < 4 * d:
        raise SpecheadError(f"{fit.shape[0]} drafter states fit a rank-{r} head poorly; give at least {4 * d}")
    moment = (fit.double().T @ fit.double()) / fit.shape[0]
    proj, down = whitened_factors(w, r, moment)
    up = w @ proj
    svd_up, svd_down = svd_factors(w, r)
    ref = argmax_rows(held, lambda h: h @ w.T)  # the full head's choices, computed once for both comparisons
    report = {
        "rank": r,
        "fit_states": fit.shape[0],
        "held_out_states": held.shape[0],
        "top1_agreement_fitted": top1_agreement(ref, up, down, held),
        "top1_agreement_svd": top1_agreement(ref, svd_up, svd_down, held),
        "head_bytes_fp32": {"full": w.numel() * 4, "low_rank": (up.numel() + down.numel()) * 4},
        "stored_bytes_fp32": (proj.numel() + down.numel()) * 4,
    }
    drafter.attach_low_rank_head(target.lm_head.weight, proj, down)
    drafter.write_low_rank_head(drafter_dir)
    (drafter_dir / "lowrank_head.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
