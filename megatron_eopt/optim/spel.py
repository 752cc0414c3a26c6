"""SPEL: spectral steepest descent on the Stiefel manifold (Emerging-Optimizers 0.4 ``Spel``)."""

from __future__ import annotations

import torch
from torch.optim.optimizer import ParamsT

from ._config import coefficient_type_error
from ..ops import newton_schulz
from .._precision import fp32_matmul_precision
from .orthogonalized import OrthogonalizedOptimizer


class Spel(OrthogonalizedOptimizer):
    """SPEL (arXiv:2601.21487): ``p ← msign(p − lr·msign(M))`` with EO 0.4's constructor, defaults
    and numerics: Muon's momentum and weight decay, the raw Newton–Schulz output (no scale) as the
    update, then the updated weight re-orthogonalized by the same Newton–Schulz
    (``post_weight_update_fn_inplace``). Both run on the fused op under ``fp32_matmul_prec``.
    Weight decay still matters: it weighs the old weight against the update before the projection.
    State: ``momentum_buffer``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        weight_decay: float = 0.1,
        *,
        nesterov: bool = False,
        weight_decay_method: str = "decoupled",
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
    ) -> None:
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        # EO checks the coefficient type when a step first uses it (an unknown type, or 'custom' with
        # no rows to give here); so does step() here
        deferred_error = coefficient_type_error(coefficient_type, num_ns_steps=num_ns_steps)

        def scaled_orthogonalize_fn(x: torch.Tensor) -> torch.Tensor:
            return newton_schulz(x, steps=num_ns_steps, coefficient_type=coefficient_type)  # 2-D or a stack

        self._init_eo_style(locals(), scaled_orthogonalize_fn, deferred_error)

    def _post_weight_update_batch(self, params: list[torch.Tensor]) -> None:
        # The projection of all weights of one shape as one batched Newton–Schulz (unless a subclass
        # replaced the per-weight projection).
        if type(self).post_weight_update_fn_inplace is not Spel.post_weight_update_fn_inplace:
            return super()._post_weight_update_batch(params)
        stacks: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            stacks.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
        with fp32_matmul_precision(self.fp32_matmul_prec):
            for group in stacks.values():
                projected = self.scaled_orthogonalize_fn(torch.stack([p.to(torch.float32) for p in group]))
                for p, q in zip(group, projected.unbind(0)):
                    p.copy_(q)

    def post_weight_update_fn_inplace(self, p: torch.Tensor) -> None:
        """Projects the updated weight back onto (near) the Stiefel manifold: ``p ← msign(p)``."""
        with fp32_matmul_precision(self.fp32_matmul_prec):
            p.copy_(self.scaled_orthogonalize_fn(p))
