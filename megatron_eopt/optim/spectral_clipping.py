"""Spectral clipping of matrices by the matrix sign function (Emerging-Optimizers 0.4 utilities).

Clipping the singular values of X to [σ_min, σ_max] written with matrix signs, each computed by
Polar Express Newton–Schulz (8 steps) on the fused op (arXiv / leloykun.github.io spectral-clipping).
Precision follows torch's float32 matmul precision, as the reference does. X is 2-D fp32; tall
matrices are handled through their transpose.
"""

from __future__ import annotations

import torch

from ..ops import newton_schulz

__all__ = ["spectral_clip", "spectral_clipped_weight_decay", "spectral_hardcap"]


def _msign(x: torch.Tensor) -> torch.Tensor:
    return newton_schulz(x, steps=8, coefficient_type="polar_express")


def spectral_clip(X: torch.Tensor, sigma_min: float = -1.0, sigma_max: float = 1.0) -> torch.Tensor:
    """X with its singular values clipped to [sigma_min, sigma_max]:
    ½·[(σ_min + σ_max)·O + msign(σ_min·I − O Xᵀ)(σ_min·O − X) − msign(σ_max·I − O Xᵀ)(σ_max·O − X)],
    O = msign(X)."""
    transpose = X.shape[0] > X.shape[1]
    if transpose:
        X = X.T
    O = _msign(X)
    result = (sigma_min + sigma_max) * O
    eye = torch.eye(X.shape[0], device=X.device, dtype=X.dtype)
    for s, sign in ((sigma_min, 1), (sigma_max, -1)):
        A = torch.addmm(s * eye, O, X.T, beta=1.0, alpha=-1.0)
        B = torch.add(s * O, X, alpha=-1)
        result = torch.addmm(result, _msign(A), B, alpha=sign)
    result = result * 0.5
    return result.T if transpose else result


def spectral_hardcap(X: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """X with its singular values capped at ``beta``: ½·[βO + X − (βO − X)·msign(βO − X)ᵀ·O], O = msign(X)."""
    transpose = X.shape[0] > X.shape[1]
    if transpose:
        X = X.T
    O = _msign(X)
    aX = torch.add(beta * O, X, alpha=-1)
    result = torch.add(beta * O, X)
    result = torch.addmm(result, aX, torch.mm(_msign(aX).T, O), alpha=-1)
    result = result * 0.5
    return result.T if transpose else result


def spectral_clipped_weight_decay(X: torch.Tensor, beta: float = 1.0, c: float = 0.5) -> torch.Tensor:
    """Decoupled weight decay toward the spectral hardcap: ``(1 − c)·X + c·spectral_hardcap(X, beta)``."""
    return torch.add((1 - c) * X, spectral_hardcap(X, beta), alpha=c)
