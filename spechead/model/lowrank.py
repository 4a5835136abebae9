"""Rank-r factorisations of an LM head and the trainable low-rank linear layer (SlimSpec)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spechead.errors import SpecheadError


def check_rank(r: int, d: int) -> None:
    if r <= 0 or r >= d:
        raise SpecheadError(f"low-rank head rank must be in [1, {d - 1}] (below the hidden size {d}), got {r}")


def default_rank(d: int) -> int:
    """d/8, SlimSpec's operating point (512 for Llama-3.1-8B)."""
    return max(1, d // 8)


@torch.no_grad()
def svd_factors(weight: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """Best rank-r factors of ``weight`` [V, d]: (W_up = U_r S_r^1/2 [V, r], W_down = S_r^1/2 V_r^T [r, d]).

    Splitting S evenly keeps both factors on the same scale, which matters when they are trained further in
    bf16. V_r comes from the eigenvectors of the d x d Gram matrix W^T W rather than a full SVD: for a head
    (V >> d) that is V d^2 flops, several times fewer than an SVD's, and the product W V_r V_r^T reaches
    Eckart-Young's optimal Frobenius error to rounding. Then U_r S_r = W V_r, its column norms are S_r.
    Computed in fp64 for small matrices, else fp32 (the d x d eigenproblem always in fp64); returned in
    ``weight``'s dtype.
    """
    V, d = weight.shape
    check_rank(r, d)
    if r > V:
        raise SpecheadError(f"low-rank head rank {r} exceeds the vocabulary size {V}")
    w = weight.detach().to(torch.float64 if weight.numel() <= 2**24 else torch.float32)
    v = torch.linalg.eigh((w.T @ w).double())[1][:, -r:].flip(-1).to(w.dtype)  # [d, r], largest first
    us = w @ v  # U_r S_r [V, r]
    root = us.double().norm(dim=0).sqrt()  # S_r^1/2
    up = torch.where(root > 0, us / root.to(w.dtype).clamp_min(torch.finfo(w.dtype).tiny), 0)
    down = root.to(w.dtype)[:, None] * v.T
    return up.to(weight.dtype).contiguous(), down.to(weight.dtype).contiguous()


@torch.no_grad()
def whitened_factors(weight: Tensor, r: int, second_moment: Tensor, ridge: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Rank-r factors of ``weight`` [V, d] that are best *for the states the head sees*: (proj [d, r],
    down [r, d]) with ``up = weight @ proj``, minimising E ||W h - up down h||^2 over h with second moment
    ``second_moment`` = E[h h^T] [d, d] (plain ``svd_factors`` is the case E[h h^T] = I).

    With S = E[h h^T]^1/2 this is Eckart-Young on W S: its top right singular vectors V_r (eigenvectors of
    S W^T W S, eigenvalues sigma^2) give W_r = (W S V_r)(V_r^T S^-1). The up-projection stays in the column
    space of W, so a checkpoint stores two [d, r] matrices and recomputes ``up`` from the target's own head at
    load (Gemma 3's 262,144 x 80 factor is 84 MB in fp32; the two small ones are 0.4 MB). ``up``'s columns
    have norm sqrt(sigma) (as ``svd_factors``'), ``down``'s rows are sqrt(sigma) V_r^T S^-1; columns come
    largest sigma first, so the first R of them are the best rank-R head for these states. ``ridge`` (relative
    to the mean eigenvalue) keeps S^-1 bounded where the states span fewer than d directions. Precision as in
    ``svd_factors`` (the d x d problems in fp64); returned in ``weight``'s dtype."""
    d = weight.shape[1]
    check_rank(r, d)
    if second_moment.shape != (d, d):
        raise SpecheadError(f"second moment must be [{d}, {d}], got {tuple(second_moment.shape)}")
    m = second_moment.double()
    m = (m + m.T) / 2
    scale = float(torch.trace(m)) / d
    if not scale > 0 or not torch.isfinite(m).all():
        raise SpecheadError("the states' second moment is zero or not finite: no states to fit a head to")
    lam, q = torch.linalg.eigh(m + ridge * scale * torch.eye(d, dtype=m.dtype, device=m.device))
    lam = lam.clamp_min(ridge * scale)
    s, s_inv = (q * lam.sqrt()) @ q.T, (q * lam.rsqrt()) @ q.T
    w = weight.detach().to(torch.float64 if weight.numel() <= 2**24 else torch.float32)  # as in svd_factors
    gram = (w.T @ w).double()
    sig2, v = torch.linalg.eigh(s @ gram @ s)
    v, sigma = v[:, -r:].flip(-1), sig2[-r:].flip(-1).clamp_min(0).sqrt()  # [d, r], largest first
    root = sigma.clamp_min(torch.finfo(torch.float64).tiny).sqrt()
    return ((s @ v) / root).to(weight.dtype).contiguous(), (root[:, None] * (v.T @ s_inv)).to(weight.dtype).contiguous()


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

    @classmethod
    def from_projection(cls, weight: Tensor, proj: Tensor, down: Tensor) -> LowRankLinear:
        """``up = weight @ proj`` (a head whose up-projection lives in the column space of ``weight`` [V, d],
        recomputed from it rather than stored: see ``whitened_factors``) and ``down``."""
        V, d = weight.shape
        if proj.shape[0] != d or down.shape != (proj.shape[1], d):
            shapes = f"proj {tuple(proj.shape)}, down {tuple(down.shape)}"
            raise SpecheadError(f"low-rank head factors do not fit a [{V}, {d}] head: {shapes}")
        m = cls(d, V, proj.shape[1]).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            m.up.weight.copy_(weight.float() @ proj.float().to(weight.device))
            m.down.weight.copy_(down)
        m.ranked = True  # columns best first (whitened_factors): a lower rank is their first R, not an SVD
        return m.requires_grad_(False)

    @torch.no_grad()
    def dense(self) -> Tensor:
        """The [V, d] product (for checks; never needed at inference)."""
        return self.up.weight @ self.down.weight
