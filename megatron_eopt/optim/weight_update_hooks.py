"""Weight-update hooks: behaviour around the final ``p -= lr * update`` of an orthogonalized optimizer.

The protocol of Emerging-Optimizers' main branch (0.5.0a0, ``weight_update_hook=`` argument):
``pre_weight_update_inplace(p, update)`` runs just before the update and returns a state (or None)
that ``post_weight_update_inplace(p, state)`` receives after it. The order in a step is
``pre_weight_update_fn_inplace``, hook pre, ``p -= lr·update``, ``post_weight_update_fn_inplace``,
hook post.

Norms are reduced in float32 whatever the tensors' dtype, and a norm below ``eps`` counts as a
numerical zero (it has no direction to project on): the rules below say what each hook does then.
The three hooks here also have a batched form (``fused_pre`` / ``fused_post`` over lists), which
the fused step of :class:`~megatron_eopt.optim.Muon` uses: one ``torch._foreach_norm`` per list
instead of a norm per parameter, with the same per-matrix arithmetic.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, TypeVar

import torch

__all__ = ["HyperballHook", "NoOpWeightUpdateHook", "RadialBrakeHook", "RelativeUpdateHook", "WeightUpdateHook"]

HookStateT = TypeVar("HookStateT")


class WeightUpdateHook(Protocol[HookStateT]):
    """What a ``weight_update_hook`` provides."""

    def pre_weight_update_inplace(self, p: torch.Tensor, update: torch.Tensor) -> HookStateT:
        """Called just before ``p.add_(update, alpha=-lr)``; may change ``update``; returns a state."""

    def post_weight_update_inplace(self, p: torch.Tensor, pre_update_state: HookStateT) -> None:
        """Called after the update and the optimizer's own post-update function."""


class NoOpWeightUpdateHook:
    """The default: leaves the update and the weight alone."""

    def pre_weight_update_inplace(self, p: torch.Tensor, update: torch.Tensor) -> None:
        return None

    def post_weight_update_inplace(self, p: torch.Tensor, pre_update_state: None) -> None:
        pass

    def fused_pre(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> Any:
        return None

    def fused_post(self, params: list[torch.Tensor], state: Any) -> None:
        pass


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Frobenius norms in float32, one 0-dim tensor per tensor."""
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32)) if tensors else []


def _check_eps(eps: float) -> None:
    if not math.isfinite(eps) or eps <= 0.0:
        raise ValueError(f"eps must be finite and positive, got {eps}")


class HyperballHook:
    """Keeps every weight on the sphere of Frobenius radius ``radius``.

    Before the update: ``update *= radius / ‖update‖`` (a numerically zero update becomes 0).
    After it: ``p *= radius / ‖p‖`` (a numerically zero weight becomes 0). MuonHyperball's rule.
    """

    def __init__(self, radius: float, eps: float = 1e-15) -> None:
        _check_eps(eps)
        if not math.isfinite(radius) or radius < eps:
            raise ValueError(f"radius must be finite and at least eps={eps}, got {radius}")
        self.radius = radius
        self.eps = eps

    def _factor(self, norm: torch.Tensor) -> torch.Tensor:
        radius = torch.as_tensor(self.radius, device=norm.device, dtype=torch.float32)
        return torch.where(norm < self.eps, torch.zeros_like(norm), radius / norm.clamp_min(self.eps))

    def _scale_to_radius_(self, tensors: list[torch.Tensor]) -> None:
        factors = [self._factor(n).to(t.dtype) for n, t in zip(_norms(tensors), tensors)]
        if tensors:
            torch._foreach_mul_(tensors, factors)

    def pre_weight_update_inplace(self, p: torch.Tensor, update: torch.Tensor) -> None:
        self._scale_to_radius_([update])
        return None

    def post_weight_update_inplace(self, p: torch.Tensor, pre_update_state: None) -> None:
        self._scale_to_radius_([p])

    def fused_pre(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        self._scale_to_radius_(updates)

    def fused_post(self, params: list[torch.Tensor], state: None) -> None:
        self._scale_to_radius_(params)


class RadialBrakeHook:
    """Damps changes of the weight norm made by an update.

    With ``r0 = ‖p‖`` before and ``r1`` after the update, ``p`` is rescaled to norm
    ``r0 + s·(r1 - r0)``, ``s = outward_scale`` when the norm grew (by at least ``eps``),
    ``inward_scale`` when it shrank, no change otherwise; a numerically zero result stays 0.
    """

    def __init__(self, outward_scale: float = 0.5, inward_scale: float = 1.0, eps: float = 1e-15) -> None:
        if not 0.0 <= outward_scale <= 1.0:
            raise ValueError(f"outward_scale must be in [0, 1], got {outward_scale}")
        if not 0.0 <= inward_scale <= 1.0:
            raise ValueError(f"inward_scale must be in [0, 1], got {inward_scale}")
        _check_eps(eps)
        self.outward_scale = outward_scale
        self.inward_scale = inward_scale
        self.eps = eps

    def _norm_or_zero(self, norm: torch.Tensor) -> torch.Tensor:
        return torch.where(norm < self.eps, torch.zeros_like(norm), norm)

    def _factor(self, pre_norm: torch.Tensor, post_norm: torch.Tensor) -> torch.Tensor:
        post_norm = self._norm_or_zero(post_norm)
        delta = post_norm - pre_norm
        outward = torch.as_tensor(self.outward_scale, device=delta.device, dtype=torch.float32)
        inward = torch.as_tensor(self.inward_scale, device=delta.device, dtype=torch.float32)
        s = torch.where(delta >= self.eps, outward, torch.where(delta <= -self.eps, inward, torch.zeros_like(delta)))
        target = pre_norm + s * delta
        return torch.where(post_norm < self.eps, torch.zeros_like(post_norm), target / post_norm.clamp_min(self.eps))

    def pre_weight_update_inplace(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        return self.fused_pre([p], [update])[0]

    def post_weight_update_inplace(self, p: torch.Tensor, pre_update_state: torch.Tensor) -> None:
        self.fused_post([p], [pre_update_state])

    def fused_pre(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._norm_or_zero(n) for n in _norms(params)]

    def fused_post(self, params: list[torch.Tensor], state: list[torch.Tensor]) -> None:
        if params:
            factors = [self._factor(r0, r1).to(p.dtype) for p, r0, r1 in zip(params, state, _norms(params))]
            torch._foreach_mul_(params, factors)


class RelativeUpdateHook:
    """Scales each update to the norm of its weight: ``update *= ‖p‖ / ‖update‖`` (0 when either
    is numerically zero), so the learning rate is the relative update size. The weight is not
    projected afterwards."""

    def __init__(self, eps: float = 1e-15) -> None:
        if eps <= 0.0:
            raise ValueError(f"eps must be positive, got {eps}")
        self.eps = eps

    def pre_weight_update_inplace(self, p: torch.Tensor, update: torch.Tensor) -> None:
        self.fused_pre([p], [update])
        return None

    def post_weight_update_inplace(self, p: torch.Tensor, pre_update_state: None) -> None:
        pass

    def fused_pre(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        if not params:
            return
        factors = []
        for w, u, t in zip(_norms(params), _norms(updates), updates):
            zero = (w < self.eps) | (u < self.eps)
            factors.append(torch.where(zero, torch.zeros_like(u), w / u.clamp_min(self.eps)).to(t.dtype))
        torch._foreach_mul_(updates, factors)

    def fused_post(self, params: list[torch.Tensor], state: None) -> None:
        pass
