"""Feature extraction from names: load the target and the chat data, then cache the features drafters
train on (``training.features.extract_features``); what ``spechead extract`` and ``train-drafter --data`` run."""

from __future__ import annotations

from pathlib import Path

import torch

from spechead.errors import SpecheadError
from spechead.model.loading import load_target
from spechead.model.tokenizer import load_tokenizer
from spechead.model.transformer import Transformer
from spechead.training.data import Example, load_examples
from spechead.training.features import extract_features


def _examples(target_folder: Path, data: list[str], max_len: int, seed: int) -> list[Example]:
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
    pack_tokens: int | None = None,
    dtype: str = "float32",
) -> Transformer:
    """Extract the features of ``data`` (examples cut to the target's context) into ``features``; returns the
    loaded target, so ``train-drafter --data`` trains on it without loading it again. ``dtype="bfloat16"`` runs
    the target in bf16 (about 3x faster where the CPU has bf16 matrix units; the features are stored in bf16
    either way, and the returned target is then bf16 too)."""
    if dtype not in ("float32", "bfloat16"):
        raise SpecheadError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    model, folder = load_target(target, dtype=getattr(torch, dtype))
    ctx = model.config.max_position_embeddings
    max_len = min(max_len, ctx)
    pack_tokens = min(max(pack_tokens or 2048, max_len), ctx)
    examples = _examples(folder, data, max_len, seed)
    model.setup_cache(pack_tokens)
    meta = {"data": data, "max_len": max_len, "seed": seed, "target": target, "target_dtype": dtype}
    extract_features(model, examples, features, arch == "eagle3", chunk_tokens, pack_tokens, meta=meta, shard=shard)
    return model
