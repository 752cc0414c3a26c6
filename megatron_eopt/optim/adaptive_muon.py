"""AdaptiveMuon: Muon with a second moment after orthogonalization (AdaMuon, NorMuon, NAMO)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.optim.optimizer import ParamsT

from ..coefficients import NS_EPS, get_muon_scale_factor
from ._config import fused_config
from ..low_memory_state import DEFAULT_BLOCK_SIZE
from .step.grouping import DEFAULT_WORKSPACE_MIB
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

    ``nd_mode``, ``sharded_mode`` and ``replica_work`` as in :class:`Muon`; with ``nd_mode="batch"`` NorMuon and NAMO
    keep one statistic per matrix (``(E, m, 1)`` / ``(E, 1, n)``, ``(E, 1)``).

    nanochat's variance reduction (NorMuon, arXiv 2510.05491, as nanochat runs it since January
    2026) is exactly ``moment2_method="normuon"`` with ``eps=1e-10`` (its floor of the statistic and
    of the renormalization's norm). The 2026 recipe options (``weight_decay_method="cautious"``,
    ``row_equilibration``, ``frobenius_renorm``, ``ns_eps_mode``, ``ns_norm_divisor``,
    ``polar_express_safety``) are those of :class:`Muon`; Muon+ renormalizes O before the second
    moment, as nanochat does.
    ``ns_eps`` as in :class:`Muon` (1e-15, Emerging-Optimizers 0.4; 1e-7 for 0.3.0).
    ``state_dtype`` / ``state_block_size`` / ``workspace_mib`` / ``overlap_backward`` as in :class:`Muon`; AdaMuon's elementwise second moment
    follows it (bf16, or ``sqrt(v)`` in fp8 e4m3 with block scales for "int8" and "fp8"); NorMuon's
    and NAMO's statistics (a vector or a scalar per matrix) stay fp32.

    As in EO 0.4, an unknown ``moment2_method`` is a TypeError raised by ``step()`` (once a param has
    a gradient) and by ``init_state()``, and a param that is not a matrix a ValueError raised by
    ``step()`` whether it has a gradient or not; nothing changes before either is raised.
    """

    _nd_error_without_grad = True  # EO's AdaptiveMuon checks every param's rank before its grad

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
        replica_work: str = "auto",
        row_equilibration: bool = False,
        frobenius_renorm: bool = False,
        ns_eps_mode: str = "clamp",
        ns_norm_divisor: float = 1.0,
        polar_express_safety: float | None = None,
        ns_eps: float = NS_EPS,
        ns_products: str = "auto",
        state_dtype: str = "fp32",
        state_block_size: int = DEFAULT_BLOCK_SIZE,
        workspace_mib: float | str | None = DEFAULT_WORKSPACE_MIB,
        overlap_backward: bool = False,
    ) -> None:
        config, deferred_error = fused_config(locals())
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, beta2=beta2, eps=eps)
        self._init_fused(params, defaults, config, nd_mode=nd_mode, sharded_mode=sharded_mode,
                         replica_work=replica_work, state_dtype=state_dtype, state_block_size=state_block_size,
                         workspace_mib=workspace_mib, deferred_error=deferred_error,
                         overlap_backward=overlap_backward)

    # ------------------------------------------------------------------ Emerging-Optimizers' extension points
    # The fused step runs these rules in its normalization ops; a subclass overriding one of them
    # gets the per-parameter step, which calls them as EO's AdaptiveMuon.step does.
    def _apply_muon_scale(self, update: torch.Tensor, size_out: int, size_in: int) -> torch.Tensor:
        """``update`` times the Muon scale of a (size_out, size_in) matrix and ``extra_scale_factor``."""
        return update * get_muon_scale_factor(size_out, size_in, self.scale_mode) * self.extra_scale_factor

    def _match_frobenius_norm(self, update: torch.Tensor, reference: torch.Tensor, eps: float) -> torch.Tensor:
        """``update`` rescaled to the Frobenius norm of ``reference`` (its own norm floored at eps)."""
        return update * (torch.linalg.vector_norm(reference) / torch.linalg.vector_norm(update).clamp_min(eps))

    def _apply_moment2_normalization(
        self,
        orth_grad: torch.Tensor,
        moment2: torch.Tensor,
        beta2: float,
        eps: float,
        *,
        raw_grad: torch.Tensor | None = None,
        pre_orth_grad: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Updates ``moment2`` in place from the raw NS output and returns the normalized update."""
        method = self.moment2_method
        if method == "adamuon":
            moment2.lerp_(orth_grad.square().to(moment2.dtype), 1 - beta2)
            return orth_grad / (moment2.sqrt() + eps)
        if method == "normuon":
            avg_dim = -1 if orth_grad.shape[-2] >= orth_grad.shape[-1] else -2
            moment2.lerp_(orth_grad.square().mean(dim=avg_dim, keepdim=True).to(moment2.dtype), 1 - beta2)
            update = orth_grad * moment2.clamp_min(eps).rsqrt()
            return self._match_frobenius_norm(update, orth_grad, eps)
        if method == "namo":
            if raw_grad is None or pre_orth_grad is None:
                raise RuntimeError("NAMO requires raw_grad and pre_orth_grad")
            moment2.lerp_(torch.linalg.vector_norm(raw_grad).square().to(moment2.dtype), 1 - beta2)
            return orth_grad * (torch.linalg.vector_norm(pre_orth_grad) / (moment2.sqrt() + eps))
        raise TypeError(f"Invalid second moment method: {method}")

    def _hook_update(self, p, orth_grad, group, state, raw_grad, pre_orth_grad) -> torch.Tensor:
        namo = self.moment2_method == "namo"
        update = self._apply_moment2_normalization(
            orth_grad=orth_grad,
            moment2=state["moment2_buffer"],
            beta2=group["beta2"],
            eps=group["eps"],
            raw_grad=raw_grad if namo else None,
            pre_orth_grad=pre_orth_grad if namo else None,
        )
        return self._apply_muon_scale(update, update.size(-2), update.size(-1))


AdaptiveMuon._fused_hook_defaults = {
    **OrthogonalizedOptimizer._fused_hook_defaults,
    **{name: AdaptiveMuon.__dict__[name] for name in ("_apply_muon_scale", "_match_frobenius_norm",
                                                      "_apply_moment2_normalization")},
}
