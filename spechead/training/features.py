"""Cache the target states drafters train on, in chunks on disk, so training never reruns the target.

One pass of the target over the tokenized data stores, per token: the id, the loss mask, the
final normed state (the EAGLE-1/2 feature, and through the frozen head the target's next-token
distribution for both objectives) and, optionally, the three fused layer inputs EAGLE-3 reads.
Examples are packed into one sequence per forward with a block-diagonal causal mask and
positions restarting at 0 for each example, which is what batching costs on a batch-1 model.
Chunks are written atomically and skipped when present, so an interrupted run resumes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.model.transformer import Transformer
from spechead.training.data import Example


@dataclass
class Chunk:
    ids: Tensor  # [N] long, examples concatenated
    mask: Tensor  # [N] bool, training targets
    starts: Tensor  # [S+1] long, example boundaries
    hidden: Tensor  # [N, d] final normed target state
    aux: Tensor | None  # [N, 3d] EAGLE-3 fused layer inputs

    @property
    def n_examples(self) -> int:
        return self.starts.numel() - 1

    def example(self, i: int) -> slice:
        return slice(int(self.starts[i]), int(self.starts[i + 1]))


def block_causal_mask(lengths: list[int], device: torch.device | None = None) -> Tensor:
    """Bool [T, T]: each token sees the earlier tokens of its own example only."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device, non_blocking=True)
    idx = torch.arange(seg.numel(), device=device)  # the segments are made on the host: no wait for a GPU
    return (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])


def packed_positions(lengths: list[int], device: torch.device | None = None) -> Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).to(device, non_blocking=True)


def pack(examples: list[Example], pack_tokens: int) -> Iterator[list[Example]]:
    """Greedy packing in order: groups whose total length stays within ``pack_tokens``."""
    group: list[Example] = []
    size = 0
    for ex in examples:
        if group and size + len(ex.ids) > pack_tokens:
            yield group
            group, size = [], 0
        group.append(ex)
        size += len(ex.ids)
    if group:
        yield group


@torch.inference_mode()
def target_states(target: Transformer, group: list[Example], want_aux: bool) -> tuple[Tensor, Tensor | None]:
    """One packed target forward: (final normed states [T, d], fused layer inputs [T, 3d] or None)."""
    lengths = [len(e.ids) for e in group]
    total = sum(lengths)
    dev = target.lm_head.weight.device
    if target.max_len < total:
        target.setup_cache(total)
    tokens = torch.tensor([t for e in group for t in e.ids], device=dev)
    out = target(
        tokens,
        0,
        positions=packed_positions(lengths, dev),
        mask=block_causal_mask(lengths, dev),
        logits_rows=None,
        want_aux=want_aux,
    )
    return out.hidden, out.aux


def extract_features(
    target: Transformer,
    examples: list[Example],
    out: Path,
    want_aux: bool = True,
    chunk_tokens: int = 65536,
    pack_tokens: int = 2048,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    meta: dict | None = None,
    shard: tuple[int, int] = (0, 1),
) -> list[Path]:
    """Write ``chunk_NNNNN.pt`` files of about ``chunk_tokens`` tokens each; existing chunks are kept.

    ``shard`` = (i, n) makes this process extract only chunks i, i+n, ... so that n processes
    (or machines sharing the folder) split the work.
    """
    from tqdm import tqdm

    if not examples:
        raise SpecheadError("no examples to extract features from")
    out.mkdir(parents=True, exist_ok=True)
    chunks = assign_chunks(examples, chunk_tokens)
    info = {**chunks_meta(target, chunks, want_aux), **(meta or {})}
    meta_path = out / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in ("tokens", "chunks", "aux")} != {k: info[k] for k in ("tokens", "chunks", "aux")}:
            raise SpecheadError(f"{out} holds features of other data; choose another --features folder")
        for k in ("target", "target_dtype"):  # fp32 and bf16 chunks, or two targets', must not mix
            if k in old and k in info and old[k] != info[k]:
                raise SpecheadError(f"{out} holds features with {k} {old[k]!r}, not {info[k]!r}; use another folder")
    meta_path.write_text(json.dumps(info, indent=2))
    paths = [out / f"chunk_{i:05d}.pt" for i in range(len(chunks))]
    todo = [i for i, p in enumerate(paths) if not p.is_file() and i % shard[1] == shard[0]]
    bar = tqdm(
        total=info["tokens"],
        initial=info["tokens"] - sum(len(e.ids) for i in todo for e in chunks[i]),
        desc="features",
        unit="tok",
        unit_scale=True,
        disable=not progress,
        dynamic_ncols=True,
    )
    for i in todo:
        c = chunk_states(target, chunks[i], want_aux, pack_tokens, dtype, torch.device("cpu"), bar.update)
        data = {"ids": c.ids, "mask": c.mask, "starts": c.starts, "hidden": c.hidden, "aux": c.aux}
        tmp = paths[i].with_suffix(".tmp")
        torch.save(data, tmp)
        os.replace(tmp, paths[i])
    bar.close()
    return paths


def assign_chunks(examples: list[Example], chunk_tokens: int) -> list[list[Example]]:
    """Examples in order, cut into chunks of about ``chunk_tokens`` tokens (deterministic, so a resumed
    extraction rebuilds the same chunks and an online run plans the same packs)."""
    chunks: list[list[Example]] = [[]]
    size = 0
    for ex in examples:
        if size >= chunk_tokens:
            chunks.append([])
            size = 0
        chunks[-1].append(ex)
        size += len(ex.ids)
    return chunks


def chunks_meta(target: Transformer, chunks: list[list[Example]], want_aux: bool) -> dict:
    """What a chunk plan holds (``meta.json`` of cached features; online features describe themselves alike)."""
    return {
        "hidden_size": target.config.hidden_size,
        "vocab_size": target.config.vocab_size,
        "aux": want_aux,
        "chunks": len(chunks),
        "examples": sum(len(c) for c in chunks),
        "tokens": sum(len(e.ids) for c in chunks for e in c),
        "targets": sum(sum(e.mask) for c in chunks for e in c),
        "lengths": [[len(e.ids) for e in c] for c in chunks],
    }


def chunk_states(
    target: Transformer,
    examples: list[Example],
    want_aux: bool,
    pack_tokens: int,
    dtype: torch.dtype,
    keep_on: torch.device,
    progress: Callable[[int], object] | None = None,
) -> Chunk:
    """One chunk's target states, packed forwards of at most ``pack_tokens`` tokens, kept on ``keep_on``."""
    hid, aux = [], []
    for group in pack(examples, pack_tokens):
        h, a = target_states(target, group, want_aux)
        hid.append(h.to(keep_on, dtype))
        if want_aux:
            aux.append(a.to(keep_on, dtype))
        if progress is not None:
            progress(h.shape[0])
    lengths = torch.tensor([len(e.ids) for e in examples])
    return Chunk(
        torch.tensor([t for e in examples for t in e.ids]),
        torch.tensor([m for e in examples for m in e.mask], dtype=torch.bool),
        torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        torch.cat(hid),
        torch.cat(aux) if want_aux else None,
    )


def load_chunk(path: Path) -> Chunk:
    try:
        d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpecheadError(f"corrupt feature chunk {path}: {e}") from e
    return Chunk(d["ids"], d["mask"].bool(), d["starts"], d["hidden"], d.get("aux"))


def feature_chunks(folder: Path) -> list[Path]:
    paths = sorted(folder.glob("chunk_*.pt"))
    if not paths:
        raise SpecheadError(f"no feature chunks in {folder}; run `spechead extract` first")
    return paths
