"""Target-side token choice: greedy, or sampling with temperature / top-k / top-p.

Acceptance of a drafted tree under sampling uses the multi-candidate rejection rule for
deterministic (point-mass) drafts: at each node the children are tried in turn, child x being
accepted with probability p(x) under the current residual p; a rejected x gets p(x) = 0 and the
residual is renormalised; if no child is accepted the bonus token is drawn from the residual. The
token emitted at each position is then distributed exactly as the target's p, whatever the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
    """The distribution the target samples from: temperature, then top-k, then top-p (HF order)."""
    z = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = z.topk(min(cfg.top_k, z.shape[-1]), dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True)
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop = (cum - sorted_z.softmax(-1)) >= cfg.top_p  # keep the smallest prefix reaching top_p
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return z.softmax(-1)


def sample(p: Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen).item())


def accept_greedy(tokens: list[int], children: list[list[int]], argmax: list[int]) -> tuple[list[int], int]:
    """Walk from the root while the target's argmax is a child. Returns (accepted nodes, bonus token)."""
    node, path = 0, [0]
    while True:
        want = argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        node = nxt
        path.append(node)


def accept_sampling(
    tokens: list[int], children: list[list[int]], logits: Tensor, cfg: SamplingConfig, gen: torch.Generator | None
) -> tuple[list[int], int]:
    """Lossless multi-candidate acceptance of a deterministic draft tree (see module docstring)."""
    node, path = 0, [0]
    while True:
        p = target_probs(logits[node], cfg)
        for c in children[node]:
            x = tokens[c]
            px = float(p[x]) / float(p.sum())
            if px > 0 and float(torch.rand((), generator=gen)) < px:
                node = c
                path.append(c)
                break
            p[x] = 0.0
        else:
            return path, sample(p / p.sum(), gen)
