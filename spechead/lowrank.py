"""SlimSpec: a low-rank draft LM head, logits = W_up (W_down h), with full-vocabulary support.

A rank-r head reads r(d + V) weights instead of dV, so at r = d/8 it moves ~8x fewer bytes while
every token stays reachable (unlike a truncated vocabulary). The factors come from an SVD of the
full head (training-free; the best rank-r approximation, Eckart-Young) or from training: a
``LowRankLinear`` module can replace a drafter's ``lm_head`` in the training pipeline.

``LowRankScorer`` is the cheap full-vocabulary scorer other heads reuse (the hybrid head asks it
for a few candidates outside its active set and then computes exact logits on them).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .heads import DraftHead, fast_topk, register_head, topk_logprobs  # noqa: F401 (re-export)
from .kernels import PackedLinear  # noqa: F401 (re-export)
from .loading import SpecheadError

# The exact chunked top-k lives with the head interface; re-exported here for the other heads.
fast_topk_logprobs = topk_logprobs


def check_rank(r: int, d: int) -> None:
    if r <= 0 or r >= d:
        raise SpecheadError(f"low-rank head rank must be in [1, {d - 1}] (below the hidden size {d}), got {r}")


def default_rank(d: int) -> int:
    """d/8, SlimSpec's operating point (512 for Llama-3.1-8B)."""
    return max(1, d // 8)


@torch.no_grad()
def svd_factors(weight: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Best rank-r factors of ``weight`` [V, d]: (W_up = U_r S_r^1/2 [V, r], W_down = S_r^1/2 V_r^T [r, d]).

    Splitting S evenly keeps both factors on the same scale, which matters when they are trained
    further in bf16. Computed in fp32 (fp64 for small matrices), returned in ``weight``'s dtype.
    """
    V, d = weight.shape
    check_rank(r, d)
    if r > V:
        raise SpecheadError(f"low-rank head rank {r} exceeds the vocabulary size {V}")
    w = weight.detach().to(torch.float64 if weight.numel() <= 2**24 else torch.float32)
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[:r].sqrt()
    up = u[:, :r] * root
    down = root[:, None] * vh[:r]
    return up.to(weight.dtype).contiguous(), down.to(weight.dtype).contiguous()


@torch.no_grad()
def truncate_factors(up: Tensor, down: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Re-truncate an existing factorisation up @ down to rank r without forming the [V, d] product."""
    check_rank(r, down.shape[1])
    if r > up.shape[1]:
        raise SpecheadError(f"cannot raise a rank-{up.shape[1]} head to rank {r}")
    qu, ru = torch.linalg.qr(up.double())
    qd, rd = torch.linalg.qr(down.double().T)
    a, s, bh = torch.linalg.svd(ru @ rd.T)
    root = s[:r].sqrt()
    new_up = (qu @ a[:, :r]) * root
    new_down = root[:, None] * (bh[:r] @ qd.T)
    return new_up.to(up.dtype).contiguous(), new_down.to(down.dtype).contiguous()


class LowRankLinear(nn.Module):
    """Drop-in replacement for a bias-free ``nn.Linear(d, V)``: ``up(down(x))``.

    Parameters are ``down.weight`` [r, d] and ``up.weight`` [V, r] (TorchSpec's ``lm_head.down`` /
    ``lm_head.up`` layout), so a drafter's checkpoint stores the two factors and never the product.
    """

    def __init__(self, d: int, vocab_size: int, r: int) -> None:
        super().__init__()
        check_rank(r, d)
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, vocab_size, bias=False)

    @property
    def rank(self) -> int:
        return self.down.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.down.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.up.weight.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return self.up(self.down(x))

    @classmethod
    def from_svd(cls, weight: Tensor, r: int) -> LowRankLinear:
        """Initialise from the best rank-r approximation of a full head ``weight`` [V, d]."""
        V, d = weight.shape
        m = cls(d, V, r).to(device=weight.device, dtype=weight.dtype)
        up, down = svd_factors(weight, r)
        with torch.no_grad():
            m.up.weight.copy_(up)
            m.down.weight.copy_(down)
        return m

    @classmethod
    def from_random(
        cls,
        d: int,
        vocab_size: int,
        r: int,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LowRankLinear:
        """Seeded random init whose logits have the variance of a std-0.02 full head's."""
        m = cls(d, vocab_size, r)
        std = 0.02**0.5 / r**0.25  # var(logit) = r * std^4 * d * var(h) = 0.02^2 * d * var(h)
        with torch.no_grad():
            m.down.weight.copy_(torch.randn(m.down.weight.shape, generator=generator) * std)
            m.up.weight.copy_(torch.randn(m.up.weight.shape, generator=generator) * std)
        return m.to(device=device, dtype=dtype)

    @torch.no_grad()
    def dense(self) -> Tensor:
        """The [V, d] product (for checks; never needed at inference)."""
        return self.up.weight @ self.down.weight


class LowRankScorer:
    """Cheap scores for every drafter row: ``(h @ down.T) @ up.T``, r(d + V) weights read.

    Used by ``LowRankHead`` and by other heads that need a full-vocabulary escape. Indices it
    returns are *drafter rows* (map them through the head's ``row_ids`` for target ids).
    """

    def __init__(self, up: Tensor, down: Tensor) -> None:
        if up.shape[1] != down.shape[0]:
            raise SpecheadError(f"low-rank factors disagree: up {tuple(up.shape)}, down {tuple(down.shape)}")
        self.up = PackedLinear(up)  # [V, r]
        self.down = PackedLinear(down)  # [r, d]

    @classmethod
    def from_weight(cls, weight: Tensor | LowRankLinear, r: int | None = None) -> LowRankScorer:
        """From a full head (SVD at rank r, default d/8) or from a ``LowRankLinear`` (its factors,
        re-truncated when a smaller r is asked for)."""
        if isinstance(weight, LowRankLinear):
            up, down = weight.up.weight.detach(), weight.down.weight.detach()
            if r is not None and r != up.shape[1]:
                up, down = truncate_factors(up, down, r)
            return cls(up, down)
        d = weight.shape[1]
        return cls(*svd_factors(weight, default_rank(d) if r is None else r))

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def nbytes(self) -> int:
        return self.up.nbytes + self.down.nbytes

    def logits(self, h: Tensor) -> Tensor:
        """Scores [B, V_draft] in float32."""
        return self.up(self.down(h))

    def candidates(self, h: Tensor, n: int, exclude: Tensor | None = None) -> Tensor:
        """The n best-scoring drafter rows per state [B, n], skipping rows where ``exclude`` [V_draft] is True
        (e.g. the rows a head already scores exactly)."""
        s = self.logits(h)
        if exclude is not None:
            s = s.masked_fill(exclude, float("-inf"))
        return s.topk(min(n, s.shape[-1]), dim=-1).indices


@register_head("lowrank")
class LowRankHead(DraftHead):
    """SlimSpec head: ``lowrank`` (rank d/8, or the drafter's own low-rank head) or ``lowrank:R``.

    The draft distribution is the softmax of the low-rank logits over the full drafter vocabulary.
    """

    def __init__(
        self,
        weight: Tensor | LowRankLinear,
        row_ids: Tensor | None,
        vocab_size: int,
        rank: int | None = None,
    ) -> None:
        super().__init__(weight, row_ids, vocab_size)
        d = weight.in_features if isinstance(weight, LowRankLinear) else weight.shape[1]
        if rank is not None:
            check_rank(rank, d)
        self.scorer = LowRankScorer.from_weight(weight, rank)

    @classmethod
    def from_spec(cls, arg: str, weight: Tensor, row_ids: Tensor | None, vocab_size: int) -> LowRankHead:
        try:
            rank = int(arg)
        except ValueError:
            raise SpecheadError(f"lowrank head wants an integer rank (lowrank:R), got {arg!r}") from None
        return cls(weight, row_ids, vocab_size, rank)

    def topk(self, h: Tensor, k: int) -> tuple[Tensor, Tensor]:
        with self.timers("head", h.device):
            return topk_logprobs(self.scorer.logits(h), k, self.row_ids)

    def stats(self) -> dict[str, float]:
        return {"rank": float(self.scorer.rank)}

    def extra_bytes(self) -> int:
        return self.scorer.nbytes
