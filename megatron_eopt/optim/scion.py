"""Scion: stochastic conditional descent with operator norms (Emerging-Optimizers 0.4 ``Scion``)."""

from __future__ import annotations

from torch.optim.optimizer import ParamsT

from ._config import defer_step_time_errors, make_config
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
        arguments, deferred_error = defer_step_time_errors(dict(
            nesterov=False,
            weight_decay_method="decoupled",
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            custom_coefficient_sets=None,
            num_ns_steps=num_ns_steps,
            scale_mode="unit_rms_norm",
            extra_scale_factor=spectral_radius,
        ))
        config = make_config(**arguments)
        self.nesterov = False
        self.weight_decay_method = "decoupled"
        self.fp32_matmul_prec = fp32_matmul_prec
        self._init_fused(params, dict(lr=lr, momentum=momentum, weight_decay=1), config, deferred_error=deferred_error)
