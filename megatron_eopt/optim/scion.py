"""Scion: stochastic conditional descent with operator norms (Emerging-Optimizers 0.4 ``Scion``)."""

from __future__ import annotations

from torch.optim.optimizer import ParamsT

from ._config import fused_config
from .orthogonalized import OrthogonalizedOptimizer


class Scion(OrthogonalizedOptimizer):
    """Scion (arXiv:2502.07529) with EO 0.4's constructor, defaults and numerics, on the fused step.

    Per 2-D parameter: ``p -= lr·p`` (Scion's Frank–Wolfe step: EO fixes weight_decay = 1,
    decoupled), momentum EMA without Nesterov, Newton–Schulz (``coefficient_type``,
    ``num_ns_steps``, ``fp32_matmul_prec``), scaled by ``√(m/n)·spectral_radius``, ``p -= lr·update``.
    It is :class:`Muon` with ``scale_mode="unit_rms_norm"``, ``extra_scale_factor=spectral_radius``,
    ``weight_decay=1``: one batched step. State: ``momentum_buffer``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        *,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        spectral_radius: float = 1.0,
    ) -> None:
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        config, deferred_error = fused_config(
            locals(), nesterov=False, weight_decay_method="decoupled", custom_coefficient_sets=None,
            scale_mode="unit_rms_norm", extra_scale_factor=spectral_radius,
        )
        self._init_fused(params, dict(lr=lr, momentum=momentum, weight_decay=1), config, deferred_error=deferred_error)
