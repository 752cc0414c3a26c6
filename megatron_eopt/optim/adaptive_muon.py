"""AdaptiveMuon: Muon with a second moment after orthogonalization (AdaMuon, NorMuon, NAMO)."""

from __future__ import annotations

from typing import Sequence

from torch.optim.optimizer import ParamsT

from ..newton_schulz import NS_EPS
from ._config import make_config
from .orthogonalized import OrthogonalizedOptimizer


class AdaptiveMuon(OrthogonalizedOptimizer):
    """Emerging-Optimizers' ``AdaptiveMuon``: constructor, defaults, step order and state.

    As :class:`Muon` up to the raw Newton–Schulz output O, then (``moment2_method``):
    adamuon ``v ← lerp(v, O², 1-beta2)``, ``U = O / (√v + eps)`` (v shaped like p); normuon
    ``v ← lerp(v, mean(O², longer side), 1-beta2)`` (v of shape [m, 1] if m ≥ n else [1, n]),
    ``U = O·rsqrt(max(v, eps))`` rescaled to ‖O‖_F; namo ``v ← lerp(v, ‖g‖², 1-beta2)`` (v of shape
    [1]), ``U = O·‖G̃‖ / (√v + eps)``. Then ``U`` is scaled by ``scale_mode`` × ``extra_scale_factor``
    and ``p -= lr·U``. State: ``momentum_buffer``, ``moment2_buffer`` (dtype of p); ``beta2`` and
    ``eps`` live in the param groups.

    ``nd_mode`` and ``sharded_mode`` as in :class:`Muon`; with ``nd_mode="batch"`` NorMuon and NAMO
    keep one statistic per matrix (``(E, m, 1)`` / ``(E, 1, n)``, ``(E, 1)``).
    ``ns_eps`` as in :class:`Muon` (1e-15, Emerging-Optimizers 0.4; 1e-7 for 0.3.0).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float,
        weight_decay: float,
        *,
        nesterov: bool = False,
        weight_decay_method: str = "decoupled",
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        moment2_method: str = "adamuon",
        beta2: float = 0.95,
        eps: float = 1e-8,
        custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
        nd_mode: str = "error",
        sharded_mode: str = "owner",
        ns_eps: float = NS_EPS,
    ) -> None:
        config = make_config(
            nesterov=nesterov,
            weight_decay_method=weight_decay_method,
            fp32_matmul_prec=fp32_matmul_prec,
            coefficient_type=coefficient_type,
            custom_coefficient_sets=custom_coefficient_sets,
            num_ns_steps=num_ns_steps,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            ns_eps=ns_eps,
            moment2_method=moment2_method,
        )
        self.nesterov = config.nesterov
        self.weight_decay_method = weight_decay_method
        self.fp32_matmul_prec = fp32_matmul_prec
        self.moment2_method = moment2_method
        self.scale_mode = scale_mode
        self.extra_scale_factor = config.extra_scale_factor
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, beta2=beta2, eps=eps)
        super().__init__(params, defaults, config, nd_mode=nd_mode, sharded_mode=sharded_mode)
