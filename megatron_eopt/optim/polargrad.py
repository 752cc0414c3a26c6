"""PolarGrad: polar-gradient methods (Emerging-Optimizers 0.4 ``PolarGrad`` and its one-sided functions)."""

from __future__ import annotations

from typing import Literal

import torch
from torch.optim.optimizer import ParamsT

from ._config import coefficient_type_error
from ..ops import newton_schulz
from .orthogonalized import OrthogonalizedOptimizer

__all__ = ["PolarGrad", "left_polargrad_orth_fn", "one_sided_polargrad_orth_fn", "right_polargrad_orth_fn"]


class PolarGrad(OrthogonalizedOptimizer):
    """PolarGrad (arXiv:2505.21799): Muon's step with the update scaled by the nuclear norm of the
    momentum, estimated as ``⟨NS(M), M⟩``; EO 0.4's constructor, defaults (fp32 "highest" matmuls)
    and numerics. ``num_ns_steps=0`` skips the iteration (the normalized momentum is the update).

    The Newton–Schulz runs on the fused op under ``fp32_matmul_prec``; the step is EO's
    per-parameter loop (the scale is a per-matrix reduction of the NS output). State:
    ``momentum_buffer``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.01,
        *,
        nesterov: bool = False,
        weight_decay_method: str = "decoupled",
        fp32_matmul_prec: str = "highest",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        extra_scale_factor: float = 1.0,
    ) -> None:
        if num_ns_steps < 0:
            raise ValueError(f"num_ns_steps must be positive, got {num_ns_steps}")
        # EO checks the coefficient type when a step first uses it (an unknown type, or 'custom' with
        # no rows to give here); so does step() here
        deferred_error = coefficient_type_error(coefficient_type, num_ns_steps=num_ns_steps)

        def scaled_orthogonalize_fn(grad: torch.Tensor) -> torch.Tensor:
            # 2-D, or a (k, m, n) stack of momenta (the step batches equal shapes)
            orth_grad = newton_schulz(grad, steps=num_ns_steps, coefficient_type=coefficient_type)
            return orth_grad * (orth_grad * grad).sum(dim=(-2, -1), keepdim=True) * extra_scale_factor

        self._init_eo_style(locals(), scaled_orthogonalize_fn, deferred_error)


def eigh_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors of symmetric ``x``; retried in float64 when the
    solver fails in x's dtype, results in x's dtype (EO's ``eigh_with_fallback``)."""
    try:
        values, vectors = torch.linalg.eigh(x)
    except (torch.linalg.LinAlgError, RuntimeError):
        values, vectors = torch.linalg.eigh(x.to(torch.float64))
    return values.to(x.dtype).flip(-1), vectors.to(x.dtype).flip(-1)


def one_sided_polargrad_orth_fn(
    grad: torch.Tensor,
    *,
    side: Literal["left", "right"],
    alpha: float = 1.0,
    center_rows: bool = False,
    eps: float = 1e-15,
    extra_scale_factor: float = 1.0,
) -> torch.Tensor:
    """One-sided polar orthogonalization: ``(G Gᵀ)^{-1/2} G`` (left, wide matrices such as a router)
    or ``G (Gᵀ G)^{-1/2}`` (right, tall matrices such as an embedding), times ``‖G‖_*^alpha`` and
    ``extra_scale_factor``. Gram eigenvalues are floored at ``eps``; those below the solver's
    resolution (``λ_max · n · ε_float32``) are dropped. ``center_rows`` makes each column zero-mean
    before and after. Returns ``grad``'s dtype. ValueError for another ``side``."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    m = grad.to(torch.float32)
    if center_rows:
        m = m - m.mean(dim=0, keepdim=True)
    gram = m @ m.mT if side == "left" else m.mT @ m
    values, vectors = eigh_descending(gram)
    values.clamp_min_(eps)
    cutoff = values.amax() * gram.shape[-1] * torch.finfo(m.dtype).eps
    inv_sqrt = torch.where(values > cutoff, values.rsqrt(), torch.zeros_like(values))
    gram_inv_sqrt = (vectors * inv_sqrt.unsqueeze(-2)) @ vectors.mT
    u = gram_inv_sqrt @ m if side == "left" else m @ gram_inv_sqrt
    update = u * values.sqrt().sum().pow(alpha) * extra_scale_factor
    if center_rows:
        update = update - update.mean(dim=0, keepdim=True)
    return update.to(grad.dtype)


def right_polargrad_orth_fn(grad: torch.Tensor, *, alpha: float = 1.0, center_rows: bool = False,
                            eps: float = 1e-15, extra_scale_factor: float = 1.0) -> torch.Tensor:
    """:func:`one_sided_polargrad_orth_fn` with ``side="right"`` (tall matrices)."""
    return one_sided_polargrad_orth_fn(grad, side="right", alpha=alpha, center_rows=center_rows, eps=eps,
                                       extra_scale_factor=extra_scale_factor)


def left_polargrad_orth_fn(grad: torch.Tensor, *, alpha: float = 1.0, center_rows: bool = False,
                           eps: float = 1e-15, extra_scale_factor: float = 1.0) -> torch.Tensor:
    """:func:`one_sided_polargrad_orth_fn` with ``side="left"`` (wide matrices)."""
    return one_sided_polargrad_orth_fn(grad, side="left", alpha=alpha, center_rows=center_rows, eps=eps,
                                       extra_scale_factor=extra_scale_factor)
