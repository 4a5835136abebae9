"""Feature extraction from names: load the target and the chat data, then cache the features drafters
train on (``training.features.extract_features``); what ``spechead extract`` and ``train-drafter --data`` run, and the
same chunks computed as training needs them (``train-drafter --online``)."""

from __future__ import annotations

from pathlib import Path

import torch

from spechead.errors import SpecheadError
from spechead.model.loading import load_target
from spechead.model.tokenizer import load_tokenizer
from spechead.model.transformer import Transformer
from spechead.training.data import Example, load_examples
from spechead.training.features import extract_features
from spechead.training.loop import OnlineChunks


def _cut(
    model: Transformer, folder: Path, data: list[str], max_len: int, seed: int, pack_tokens: int | None
) -> tuple[list[Example], int, int]:
    """The examples cut to the target's context, that length, and the tokens per target forward (at least it)."""
    ctx = model.config.max_position_embeddings
    max_len = min(max_len, ctx)
    pack_tokens = min(max(pack_tokens or 2048, max_len), ctx)
    return load_examples(load_tokenizer(folder), data, max_len=max_len, seed=seed), max_len, pack_tokens


def online_features(
    target: str, data: list[str], arch: str, max_len: int, seed: int, chunk_tokens: int, device: torch.device
) -> OnlineChunks:
    """``train-drafter --online``: the target on ``device`` and ``extract``'s chunks of ``data``, their states
    computed as training needs them."""
    model, folder = load_target(target, device=device)
    examples, _, pack_tokens = _cut(model, folder, data, max_len, seed, None)
    return OnlineChunks(model, examples, chunk_tokens, pack_tokens, arch == "eagle3")


def extract_to(
    target: str,
    data: list[str],
    features: Path,
    arch: str,
    max_len: int,
    seed: int,
    chunk_tokens: int,
    shard: tuple[int, int] = (0, 1),
    pack_tokens: int | None = None,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
) -> Transformer:
    """Extract the features of ``data`` (examples cut to the target's context) into ``features``; returns the
    loaded target, so ``train-drafter --data`` trains on it without loading it again. ``dtype="bfloat16"`` runs
    the target in bf16 (faster where the CPU has bf16 matrix units; the features are stored in bf16
    either way, and the returned target is then bf16 too). On a GPU ``device`` the target runs there and the chunks
    are written from host memory as on a CPU: several drafters then train from one computation of the states, where
    ``--online`` would compute them once per training run."""
    if dtype not in ("float32", "bfloat16"):
        raise SpecheadError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    model, folder = load_target(target, dtype=getattr(torch, dtype), device=device)
    examples, max_len, pack_tokens = _cut(model, folder, data, max_len, seed, pack_tokens)
    model.setup_cache(pack_tokens)
    meta = {"data": data, "max_len": max_len, "seed": seed, "target": target, "target_dtype": dtype}
    extract_features(model, examples, features, arch == "eagle3", chunk_tokens, pack_tokens, meta=meta, shard=shard)
    return model
