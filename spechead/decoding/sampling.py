"""Target-side token choice: greedy, or sampling with temperature / top-k / top-p.

A request's randomness is one draw per sequence position (``Draws``): the token sampled at position t is the
first arrival of independent exponential clocks with rates p_t(v) (the exponential-race form of the Gumbel-max
trick), an exact draw from the target's p_t whose noise depends only on the request's seed and t. Acceptance of
a drafted tree under sampling is then the greedy walk with that token in place of the argmax: a child is accepted
when it is the token the target samples at its position. For point-mass drafts this accepts a child with the
probability of the recursive rejection rule (the sum of p over the children tried) and emits tokens distributed
exactly as the target's p, whatever the drafter; and since what is sampled at a position does not depend on how
it was reached, a seeded request gives the same text as AR, whatever the tree, the batch or the guard.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from torch import Tensor

from spechead import kernels


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """The distribution the target samples from: temperature, then top-k, then top-p (HF order). The row's maximum
    is taken off before dividing, and the divisor is at least float32's smallest normal number, so a temperature
    near 0 gives the argmax's point mass (dividing first overflowed to inf - inf = nan below ~1e-37, and a
    temperature that rounds to 0 in float32 made 0 / 0: the sample failed)."""
    z = logits.float()
    z = (z - z.amax(dim=-1, keepdim=True)) / max(cfg.temperature, torch.finfo(torch.float32).tiny)
    if cfg.top_k:
        kth = z.topk(min(cfg.top_k, z.shape[-1]), dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop = (cum - sorted_z.softmax(-1)) >= cfg.top_p  # keep the smallest prefix reaching top_p
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return z.softmax(-1)


class Draws:
    """One request's random draws under its sampling settings, one per sequence position (see the module
    docstring)."""

    def __init__(self, seed: int, cfg: SamplingConfig) -> None:
        self.base, self.cfg = _mix(seed), cfg

    def token(self, logits: Tensor, position: int) -> int:
        """The token the target samples at ``position`` (the number of tokens before it) from this row of logits."""
        p = target_probs(logits, self.cfg)
        if not bool(torch.isfinite(p).all()):
            raise RuntimeError("the target's logits are not finite: nothing can be sampled from them")
        gen = torch.Generator(device=p.device).manual_seed(self.seed_at(position))
        # float64 clocks: a float32 draw (CUDA's has 24 bits) would all but never pick a token of p below ~1e-7
        clocks = torch.empty(p.shape, dtype=torch.float64, device=p.device).exponential_(generator=gen)
        return int((p.double() / clocks).argmax())

    def seed_at(self, position: int) -> int:
        """The generator seed for ``position``: 32 bits (torch's CPU generator keeps no more of a seed), a bijection of
        the request's base plus the position, so no two positions of a request below 2^32 share their noise."""
        return _fmix32((self.base + position) & 0xFFFFFFFF)


def _mix(seed: int) -> int:
    """splitmix64's finaliser: a request's 64-bit base from its seed (neighbouring seeds share nothing)."""
    z = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def _fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser: a bijection of [0, 2^32) that scatters neighbouring values."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def make_draws(cfg: SamplingConfig) -> Draws | None:
    """A request's random draws (seeded when the request says so); None for greedy decoding."""
    if cfg.greedy:
        return None
    return Draws(cfg.seed if cfg.seed is not None else secrets.randbits(63), cfg)  # (torch.seed() reseeds torch's RNG)


def greedy(logits: Tensor) -> list[int]:
    """Each row's argmax, the lowest index among equal maxima. Where spechead's kernels run, their one-pass top-1
    (``row_topk``): 8 us against ``Tensor.argmax``'s 56 for the demo's 49,152 logits, 27 against 263 for Gemma 3's
    262,144 (AMD EPYC Zen 3, 2 threads). The two agree on every row without NaN (the kernel ranks NaN lowest)."""
    rows = logits.reshape(-1, logits.shape[-1])
    if kernels.row_topk_supported(rows, 1):
        return kernels.row_topk(rows.contiguous(), 1)[1][:, 0].tolist()
    return rows.argmax(-1).tolist()


def choose(logits: Tensor, draws: Draws | None, position: int) -> int:
    """The target's token at ``position`` from one row of logits: its argmax, or its sampled token there."""
    return greedy(logits)[0] if draws is None else draws.token(logits, position)


def accept(
    tokens: list[int], parents: list[int], logits: Tensor, draws: Draws | None, first: int
) -> tuple[list[int], list[int]]:
    """A verified tree's accepted path (node indices from the root) and the tokens it commits (the path's drafts
    and the bonus): walk from the root while the token the target picks at a node (its argmax, or the token it
    samples at that node's position, the root's being ``first``) is one of the node's children."""
    children: list[list[int]] = [[] for _ in tokens]
    for node, par in enumerate(parents[1:], start=1):
        children[par].append(node)
    argmax = greedy(logits) if draws is None else []  # one pass over every row, greedy
    node, path = 0, [0]
    while True:
        tok = argmax[node] if draws is None else draws.token(logits[node], first + len(path) - 1)
        nxt = next((c for c in children[node] if tokens[c] == tok), None)
        if nxt is None:
            return path, [tokens[n] for n in path[1:]] + [tok]
        node = nxt
        path.append(node)
