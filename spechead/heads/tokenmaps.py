"""Token-map files (FR-Spec / VocabTrim lists): where they live, how they are read and checked."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from spechead.cache import cache_dir
from spechead.errors import SpecheadError

SHIPPED_VOCAB = Path(__file__).parent.parent / "drafters" / "vocab"


# -- token-map files ---------------------------------------------------------------------------
def vocab_dirs(vocab_size: int) -> list[Path]:
    """Where default lists for a target of this vocabulary size are looked up, first match wins."""
    return [cache_dir() / "vocab" / f"v{vocab_size}", SHIPPED_VOCAB / f"v{vocab_size}"]


def save_token_map(ids: list[int], path: str | Path) -> Path:
    """Write ids as SGLang's ``--speculative-token-map`` file (a pickled list of Python ints)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save([int(i) for i in ids], path)
    return path


def load_token_map(path: str | Path, vocab_size: int) -> Tensor:
    """Read and validate a token-map file: a non-empty list (or 1-D int tensor) of distinct ids in [0, V)."""
    path = Path(path)
    if not path.is_file():
        raise SpecheadError(f"token list not found: {path}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle / zip errors come in many types
        raise SpecheadError(f"cannot read token list {path}: {e}") from e
    if isinstance(obj, Tensor):
        if obj.dim() != 1 or obj.is_floating_point() or obj.is_complex():
            raise SpecheadError(f"token list {path} must be a 1-D integer tensor, got {obj.dtype} {tuple(obj.shape)}")
        ids = obj.long()
    elif isinstance(obj, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in obj):
        ids = torch.tensor(obj, dtype=torch.long)
    else:
        raise SpecheadError(f"token list {path} must be a list of ints (SGLang --speculative-token-map format)")
    return check_token_ids(ids, vocab_size, str(path))


def check_token_ids(ids: Tensor, vocab_size: int, what: str) -> Tensor:
    if ids.numel() == 0:
        raise SpecheadError(f"token list {what} is empty")
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise SpecheadError(f"token list {what} has id {int(ids[bad][0])} outside the vocabulary [0, {vocab_size})")
    uniq, counts = ids.unique(return_counts=True)
    if uniq.numel() != ids.numel():
        raise SpecheadError(f"token list {what} has duplicate ids, e.g. {int(uniq[counts > 1][0])}")
    return ids


def find_token_map(kind: str, n: int, vocab_size: int, longest: bool = False) -> Path:
    """The default ``<kind>_<n>.pt``, else the shortest longer list (the caller truncates it), or with
    ``longest`` the longest list of at least n ids. The first folder of ``vocab_dirs`` holding one wins."""
    for folder in vocab_dirs(vocab_size):
        found = []
        for f in folder.glob(f"{kind}_*.pt"):
            size = f.stem.rsplit("_", 1)[1]
            if size.isdigit() and int(size) >= n:
                found.append((int(size), f))
        if found:
            return max(found)[1] if longest else min(found)[1]
    cmd = "spechead freq --tokenizer demo" if kind == "freq" else "spechead vocabtrim --target demo --drafter demo"
    raise SpecheadError(
        f"no {kind} list of at least {n} ids for vocabulary size {vocab_size} in "
        f"{' or '.join(str(d) for d in vocab_dirs(vocab_size))}; make one with `{cmd} ...` or pass a file"
    )
