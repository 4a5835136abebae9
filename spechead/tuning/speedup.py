"""SlimSpec's speedup model: speedup = rho_tau (1 + kappa) / (1 + nu kappa)."""

from __future__ import annotations


def speedup_model(kappa: float, nu: float, rho_tau: float) -> float:
    """SlimSpec's model: round time (1 + nu kappa) relative to the full head's (1 + kappa), tau scaled by rho_tau."""
    return rho_tau * (1 + kappa) / (1 + nu * kappa)
