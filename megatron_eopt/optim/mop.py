"""MOP: momentum orthogonalized by polar decomposition (Emerging-Optimizers 0.4 ``MOP``)."""

from __future__ import annotations

import torch
from torch.optim.optimizer import ParamsT

from ..coefficients import SCALE_MODES, get_muon_scale_factor
from .orthogonalized import OrthogonalizedOptimizer

__all__ = ["MOP", "polar_via_svd"]

MOP_SCALE_MODES = ("nuclear_norm", *SCALE_MODES)


class MOP(OrthogonalizedOptimizer):
    """MOP with EO 0.4's constructor, defaults (fp32 "highest") and numerics: Muon's momentum and
    weight decay, the exact polar factor ``U Vᵀ`` of the momentum from an SVD (no Newton–Schulz),
    scaled by its nuclear norm (``scale_mode="nuclear_norm"``, PolarGrad's rule) or a Muon scale
    mode, times ``extra_scale_factor``. EO marks it experimental. State: ``momentum_buffer``."""

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
        scale_mode: str = "nuclear_norm",
        extra_scale_factor: float = 1.0,
    ) -> None:
        deferred_error = None  # EO checks scale_mode when a step first uses it; so does step() here
        if scale_mode not in MOP_SCALE_MODES:
            deferred_error = ("scale_mode", ValueError,
                              f"scale_mode must be one of {list(MOP_SCALE_MODES)}, got {scale_mode!r}")

        def scaled_orthogonalize_fn(grad: torch.Tensor) -> torch.Tensor:
            # 2-D, or a (k, m, n) stack of momenta (one batched SVD for equal shapes)
            orth_grad, _, singular_values = polar_via_svd(grad, False)
            if scale_mode == "nuclear_norm":
                scale = singular_values.sum(dim=-1)[..., None, None]
            else:
                scale = get_muon_scale_factor(grad.size(-2), grad.size(-1), mode=scale_mode)
            return orth_grad * scale * extra_scale_factor

        self._init_eo_style(locals(), scaled_orthogonalize_fn, deferred_error)


def polar_via_svd(a: torch.Tensor, return_p: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Polar decomposition ``a = U_polar · P`` from the thin SVD: ``(U_polar, P or None, singular values)``;
    ``P = V diag(S) Vᴴ`` only when ``return_p``."""
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    polar = u @ vh
    return polar, (vh.mH @ torch.diag_embed(s) @ vh if return_p else None), s
