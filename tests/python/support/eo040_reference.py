"""Emerging-Optimizers 0.4.0's orthogonalized family re-expressed from its behaviour, in float64.

Written from reading EO's sources at tag v0.4.0 (``emerging_optimizers/orthogonalized_optimizers``,
``mixin.py``, ``registry.py``, ``contrib/muown.py``); nothing of EO is imported. Each class is a
``torch.optim.Optimizer`` with EO's constructor (argument names, order, keyword-only split and
defaults), EO's param-group keys and state keys, EO's per-parameter step and EO's extension
points, so a subclass overriding one of them behaves as the same subclass of EO's class would:

- ``OrthogonalizedOptimizer``: weight decay (``_apply_weight_decay_inplace``), EMA momentum,
  optional Nesterov, ``orthogonalize(p, grad, **group)`` (2-D only, then
  ``scaled_orthogonalize_fn``), ``pre_weight_update_fn_inplace(p, update)``, ``p -= lr * update``,
  ``post_weight_update_fn_inplace(p)``;
- ``Muon``, ``Scion``, ``MOP``, ``PolarGrad``, ``Spel``, ``MuonHyperball``: their
  ``scaled_orthogonalize_fn`` and hooks; ``AdaptiveMuon`` with its own step and the hooks
  ``_apply_moment2_normalization``, ``_match_frobenius_norm``, ``_apply_muon_scale``; ``Muown``
  (EO's contrib, not registered) with its weight-norm split and Adam magnitude step;
- Newton–Schulz with 0.4.0's coefficient tables, iteration modes and eps (1e-15), the scale
  modes, spectral clipping, the one-sided PolarGrad functions and EO's class registry.

Exceptions are raised where and as EO raises them (type and moment: constructor or ``step()``),
which for a few cases is only after EO changed some state; the tests compare only the type and
the moment there. Not modelled: EO's Newton–Schulz takes float32 only, so its NS-based classes
raise a TypeError at ``step()`` for bf16 / fp16 parameters (their momentum has the parameter's
dtype); megatron-eopt's classes accept such parameters.

The math runs in float64: give the optimizers float64 parameters (and gradients) for numerics.
On float32 parameters they run too (Newton–Schulz in float64, rounded back), which is what the
structure and error tests use. ``fp32_matmul_prec`` is kept, as EO keeps it, and ignored: there
is no bf16 or TF32 emulation here, so results at EO's "medium" default are compared with the
bf16 tolerance.
"""

from __future__ import annotations

import inspect
import itertools
import math
from functools import partial
from typing import Any, Callable

import torch

# ------------------------------------------------------------------ Newton–Schulz
NS_EPS = 1e-15  # 0.4.0's default floor on the Frobenius norm (0.3.0 used 1e-7)
NS_INPUT_DTYPE = torch.float32  # EO's newton_schulz refuses any other dtype (TypeError)

# (a, b, c) rows of a + b·A + c·A² per step, A = X Xᵀ, as tabulated by EO 0.4.0 (float32-rounded
# decimal values). A row with c == 0 is a cubic step.
COEFFICIENTS: dict[str, list[tuple[float, float, float]]] = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "polar_express": [
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ],
    "cans": [
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ],
    "aol": [
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ],
    "deepseekv4": 8 * [(3.4445, -4.7750, 2.0315)] + 2 * [(2.0, -1.5, 0.5)],
    "cubic5": [
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ],
}
COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "custom", "cubic5")
# Past the end of its table a schedule starts over ("cycle") except these, which keep their last row.
REPEAT_LAST_TYPES = ("polar_express", "cans", "deepseekv4")
FIXED_LENGTH_TYPES = ("cubic5",)  # any other step count is a ValueError


def get_coefficient_iterator(steps, coefficient_sets, mode="cycle"):
    """``steps`` rows taken from ``coefficient_sets``: cycled, or its last row repeated."""
    if len(coefficient_sets) == 0:
        raise ValueError("coefficient_sets must be non-empty.")
    rows = list(coefficient_sets)
    if mode == "cycle":
        source = (rows[i % len(rows)] for i in itertools.count())
    elif mode == "repeat_last":
        source = (rows[min(i, len(rows) - 1)] for i in itertools.count())
    else:
        raise ValueError(f"Invalid mode: {mode}. Expected 'cycle' or 'repeat_last'.")
    return itertools.islice(source, steps)


def coefficient_schedule(coefficient_type="quintic", steps=5, custom_coefficient_sets=None):
    """The rows Newton–Schulz runs, with EO's ValueErrors for an unusable type or step count."""
    if coefficient_type == "custom":
        if custom_coefficient_sets is None:
            raise ValueError("custom_coefficient_sets must be provided when coefficient_type is 'custom'.")
        rows = [tuple(r) for r in custom_coefficient_sets]
    elif coefficient_type in COEFFICIENTS:
        rows = COEFFICIENTS[coefficient_type]
    else:
        raise ValueError(f"Invalid coefficient type: {coefficient_type}")
    if coefficient_type in FIXED_LENGTH_TYPES and steps != len(rows):
        raise ValueError(f"{coefficient_type} is a fixed {len(rows)}-step schedule; got steps={steps}")
    mode = "repeat_last" if coefficient_type in REPEAT_LAST_TYPES else "cycle"
    return list(get_coefficient_iterator(steps, rows, mode))


def _ns(x, steps, coefficient_type="quintic", custom_coefficient_sets=None, eps=NS_EPS, transpose=None,
        normalize_in_double=False):
    """Newton–Schulz in float64 on a 2-D or batched 3-D tensor; the result in x's dtype.

    The short side is whitened (transpose when rows > columns, unless told); X / max(||X||_F, eps)
    per matrix (no floor with ``normalize_in_double``); then per row (a, b, c):
    X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ.
    """
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    X = x.detach().to(torch.float64)
    if transpose:
        X = X.mT
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    X = X / (norm if normalize_in_double else norm.clamp_min(eps))
    # the schedule is looked up after normalizing, as EO does (no difference in what is raised)
    for a, b, c in coefficient_schedule(coefficient_type, steps, custom_coefficient_sets):
        A = X @ X.mT
        X = a * X + (b * A + c * (A @ A)) @ X
    if transpose:
        X = X.mT
    return X.to(x.dtype)


def newton_schulz(x, steps, coefficient_type="quintic", custom_coefficient_sets=None, eps=NS_EPS, transpose=None,
                  tp_group=None, use_syrk=False, normalize_in_double=False):
    """EO 0.4.0's ``newton_schulz`` (same parameters and defaults): 2-D or 3-D float32 input
    (TypeError otherwise), computed here in float64, returned in float64. ``tp_group`` must be
    None here; ``use_syrk`` changes nothing in exact arithmetic."""
    del use_syrk
    if x.ndim < 2 or x.ndim > 3:
        raise TypeError(f"Input tensor x must be 2d or 3d (batched 2d), got {x.ndim}d")
    if x.dtype != NS_INPUT_DTYPE:
        raise TypeError(f"Input tensor x must be in float32, got {x.dtype}")
    if tp_group is not None:
        raise NotImplementedError("the reference has no tensor-parallel Newton-Schulz")
    return _ns(x.double(), steps, coefficient_type, custom_coefficient_sets, eps, transpose, normalize_in_double)


# ------------------------------------------------------------------ scales
SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")


def get_muon_scale_factor(size_out, size_in, mode="spectral"):
    """sqrt(max(1, out/in)), sqrt(max(out, in)) or sqrt(out/in); ValueError for any other mode."""
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, size_out / size_in))
    if mode == "spectral":
        return math.sqrt(max(size_out, size_in))
    if mode == "unit_rms_norm":
        return math.sqrt(size_out / size_in)
    raise ValueError(f"Invalid mode for Muon update scale factor: {mode}")


# ------------------------------------------------------------------ the base class
WEIGHT_DECAY_METHODS = ("decoupled", "independent", "l2", "palm")


class OrthogonalizedOptimizer(torch.optim.Optimizer):
    """EO's base: per parameter, in group order, for the parameters with a gradient.

    Param-group keys: ``lr``, ``momentum``, ``weight_decay`` and any extra keyword argument.
    State: ``momentum_buffer`` (zeros like the parameter), created for the parameters with a
    gradient at the start of each group's step. ``nesterov``, ``weight_decay_method`` and
    ``fp32_matmul_prec`` are attributes, not group keys.
    """

    def __init__(self, params, lr, momentum, weight_decay, *, nesterov, weight_decay_method, fp32_matmul_prec,
                 scaled_orthogonalize_fn=None, **kwargs):
        self.fp32_matmul_prec = fp32_matmul_prec
        self.nesterov = nesterov
        self.weight_decay_method = weight_decay_method
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, **kwargs))
        # no function given: the update is the momentum itself
        self.scaled_orthogonalize_fn = scaled_orthogonalize_fn if scaled_orthogonalize_fn is not None else _identity

    # -- extension points
    def _apply_weight_decay_inplace(self, p, grad, lr, weight_decay):
        """Nothing when weight_decay is 0 (an unknown method then passes too); otherwise
        p *= 1 - lr·wd (decoupled), 1 - wd (independent), 1 - lr²·wd (palm), or grad += wd·p in
        place (l2: the caller's gradient tensor changes). ValueError for another method."""
        if weight_decay == 0.0:
            return
        method = getattr(self, "weight_decay_method", "l2")
        if method == "decoupled":
            p.mul_(1 - lr * weight_decay)
        elif method == "independent":
            p.mul_(1 - weight_decay)
        elif method == "palm":
            p.mul_(1 - lr * lr * weight_decay)
        elif method == "l2":
            grad.add_(weight_decay * p)
        else:
            raise ValueError(f"Invalid weight decay method: {method}")

    def orthogonalize(self, p, grad, **group):
        if grad.ndim != 2:
            raise ValueError("Only 2D parameters are supported.")
        return self.scaled_orthogonalize_fn(grad)

    def pre_weight_update_fn_inplace(self, p, update):
        pass

    def post_weight_update_fn_inplace(self, p):
        pass

    @torch.no_grad()
    def _init_group(self, group, skip_non_grad_params=True):
        for p in group["params"]:
            if p.grad is None and skip_non_grad_params:
                continue
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def _momentum_input(self, grad, buf, momentum):
        """Updates the EMA buffer; returns what is orthogonalized (Nesterov: grad moved toward it)."""
        buf.lerp_(grad, 1 - momentum)
        return grad + momentum * (buf - grad) if self.nesterov else buf

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            self._init_group(group)
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                self._apply_weight_decay_inplace(p, grad, lr, group["weight_decay"])
                x = self._momentum_input(grad, self.state[p]["momentum_buffer"], group["momentum"])
                update = self.orthogonalize(p, x, **{k: v for k, v in group.items() if k != "params"})
                self.pre_weight_update_fn_inplace(p, update)
                p.add_(update, alpha=-lr)
                self.post_weight_update_fn_inplace(p)
        return None


def _identity(x):
    return x


# ------------------------------------------------------------------ Muon
class Muon(OrthogonalizedOptimizer):
    """NS(momentum) · scale(m, n, scale_mode) · extra_scale_factor. ValueError at construction
    for num_ns_steps < 1; an unknown coefficient type or scale mode only at step()."""

    def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.01, *, nesterov=False,
                 weight_decay_method="decoupled", fp32_matmul_prec="medium", coefficient_type="quintic",
                 num_ns_steps=5, scale_mode="spectral", extra_scale_factor=1.0, use_syrk=False):
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")

        def scaled_orthogonalize_fn(grad):
            out = _ns(grad, num_ns_steps, coefficient_type)
            return out * (get_muon_scale_factor(grad.size(-2), grad.size(-1), scale_mode) * extra_scale_factor)

        super().__init__(params, lr, momentum, weight_decay, nesterov=nesterov,
                         weight_decay_method=weight_decay_method, fp32_matmul_prec=fp32_matmul_prec,
                         scaled_orthogonalize_fn=scaled_orthogonalize_fn)


# ------------------------------------------------------------------ AdaptiveMuon
MOMENT2_METHODS = ("adamuon", "normuon", "namo")


class AdaptiveMuon(OrthogonalizedOptimizer):
    """Muon with a second moment between the raw NS output and Muon's scale.

    Construction: ValueError for namo with l2 weight decay, and for num_ns_steps < 1. Group keys
    gain ``beta2`` and ``eps``; state gains ``moment2_buffer``: like the parameter (adamuon),
    (rows, 1) when rows >= columns else (1, columns) (normuon; ValueError for a parameter that is
    not 2-D), or shape (1,) (namo). An unknown method is a
    TypeError when the state is created (step(), a parameter with a gradient).

    Per parameter in the step: a non-2-D parameter is a ValueError, checked before the gradient
    (so even without one); weight decay; momentum; NS; ``_apply_moment2_normalization``;
    ``_apply_muon_scale``; the pre hook, the update, the post hook.
    """

    def __init__(self, params, lr, momentum, weight_decay, *, nesterov=False, weight_decay_method="decoupled",
                 fp32_matmul_prec="medium", coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral",
                 extra_scale_factor=1.0, moment2_method="adamuon", beta2=0.95, eps=1e-8):
        if moment2_method == "namo" and weight_decay_method == "l2":
            raise ValueError('moment2_method="namo" is incompatible with weight_decay_method="l2"')
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        self.scale_mode = scale_mode
        self.extra_scale_factor = extra_scale_factor
        super().__init__(params, lr, momentum, weight_decay, nesterov=nesterov,
                         weight_decay_method=weight_decay_method, fp32_matmul_prec=fp32_matmul_prec,
                         scaled_orthogonalize_fn=lambda g: _ns(g, num_ns_steps, coefficient_type))
        self.moment2_method = moment2_method
        for group in self.param_groups:
            group.setdefault("beta2", beta2)
            group.setdefault("eps", eps)

    @torch.no_grad()
    def _init_group(self, group, skip_non_grad_params=True):
        for p in group["params"]:
            if p.grad is None and skip_non_grad_params:
                continue
            state = self.state[p]
            if state:
                continue
            state["momentum_buffer"] = torch.zeros_like(p)
            if self.moment2_method == "adamuon":
                state["moment2_buffer"] = torch.zeros_like(p)
            elif self.moment2_method == "normuon":
                if p.ndim != 2:
                    raise ValueError(f"{type(self).__name__} only supports 2D parameters, got shape {tuple(p.shape)}")
                shape = (p.shape[0], 1) if p.shape[0] >= p.shape[1] else (1, p.shape[1])
                state["moment2_buffer"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            elif self.moment2_method == "namo":
                state["moment2_buffer"] = torch.zeros(1, dtype=p.dtype, device=p.device)
            else:
                raise TypeError(f"Invalid second moment method: {self.moment2_method}")

    def _apply_muon_scale(self, update, size_out, size_in):
        return update * get_muon_scale_factor(size_out, size_in, self.scale_mode) * self.extra_scale_factor

    def _match_frobenius_norm(self, update, reference, eps):
        """update · ||reference|| / max(||update||, eps)."""
        return update * (torch.linalg.vector_norm(reference) / torch.linalg.vector_norm(update).clamp_min(eps))

    def _apply_moment2_normalization(self, orth_grad, moment2, beta2, eps, *, raw_grad=None, pre_orth_grad=None):
        """adamuon: v <- EMA(O²), O / (sqrt(v) + eps);
        normuon: v <- EMA(mean of O² per row when rows >= columns, else per column),
        U = O · rsqrt(max(v, eps)), then U rescaled to ||O||_F (``_match_frobenius_norm``);
        namo: v <- EMA(||raw grad||_F²), O · ||pre-orth momentum||_F / (sqrt(v) + eps)."""
        method = self.moment2_method
        if method == "adamuon":
            moment2.lerp_(orth_grad.square(), 1 - beta2)
            return orth_grad / (moment2.sqrt() + eps)
        if method == "normuon":
            dim = -1 if orth_grad.shape[-2] >= orth_grad.shape[-1] else -2
            moment2.lerp_(orth_grad.square().mean(dim=dim, keepdim=True), 1 - beta2)
            return self._match_frobenius_norm(orth_grad * moment2.clamp_min(eps).rsqrt(), orth_grad, eps)
        if method == "namo":
            if raw_grad is None or pre_orth_grad is None:
                raise RuntimeError("NAMO requires raw_grad and pre_orth_grad")
            moment2.lerp_(raw_grad.norm().square().reshape(1).to(moment2.dtype), 1 - beta2)
            return orth_grad * (pre_orth_grad.norm() / (moment2.sqrt() + eps))
        raise TypeError(f"Invalid second moment method: {method}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        for group in self.param_groups:
            self._init_group(group)
            lr = group["lr"]
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"{type(self).__name__} only supports 2D parameters")
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                self._apply_weight_decay_inplace(p, grad, lr, group["weight_decay"])
                x = self._momentum_input(grad, state["momentum_buffer"], group["momentum"])
                orth = self.orthogonalize(p, x, **{k: v for k, v in group.items() if k != "params"})
                namo = self.moment2_method == "namo"
                update = self._apply_moment2_normalization(
                    orth_grad=orth, moment2=state["moment2_buffer"], beta2=group["beta2"], eps=group["eps"],
                    raw_grad=grad if namo else None, pre_orth_grad=x if namo else None)
                update = self._apply_muon_scale(update, update.size(-2), update.size(-1))
                self.pre_weight_update_fn_inplace(p, update)
                p.add_(update, alpha=-lr)
                self.post_weight_update_fn_inplace(p)
        return None


# ------------------------------------------------------------------ Scion
class Scion(OrthogonalizedOptimizer):
    """Muon's step with weight_decay fixed to 1 (decoupled: p *= 1 - lr), no Nesterov, and
    NS(momentum) · sqrt(m/n) · spectral_radius."""

    def __init__(self, params, lr=3e-4, momentum=0.95, *, fp32_matmul_prec="medium", coefficient_type="quintic",
                 num_ns_steps=5, spectral_radius=1.0):
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")

        def scaled_orthogonalize_fn(grad):
            out = _ns(grad, num_ns_steps, coefficient_type)
            return out * (get_muon_scale_factor(grad.size(-2), grad.size(-1), "unit_rms_norm") * spectral_radius)

        super().__init__(params, lr, momentum, 1, nesterov=False, weight_decay_method="decoupled",
                         fp32_matmul_prec=fp32_matmul_prec, scaled_orthogonalize_fn=scaled_orthogonalize_fn)


# ------------------------------------------------------------------ MOP
def polar_via_svd(A, return_p=False):
    """(U Vᵀ, V S Vᵀ or None, singular values) from the thin SVD A = U S Vᵀ."""
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    polar = U @ Vh
    P = (Vh.mH * S.unsqueeze(-2)) @ Vh if return_p else None
    return polar, P, S


class MOP(OrthogonalizedOptimizer):
    """Exact polar factor by SVD, times the nuclear norm (sum of singular values, default) or a
    Muon scale mode, times extra_scale_factor. An unknown scale mode is a ValueError at step()."""

    def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.01, *, nesterov=False,
                 weight_decay_method="decoupled", fp32_matmul_prec="highest", scale_mode="nuclear_norm",
                 extra_scale_factor=1.0):
        def scaled_orthogonalize_fn(grad):
            polar, _, S = polar_via_svd(grad.double())
            if scale_mode == "nuclear_norm":
                scale = S.sum()
            else:
                scale = get_muon_scale_factor(grad.size(-2), grad.size(-1), scale_mode)
            return (polar * scale * extra_scale_factor).to(grad.dtype)

        super().__init__(params, lr, momentum, weight_decay, nesterov=nesterov,
                         weight_decay_method=weight_decay_method, fp32_matmul_prec=fp32_matmul_prec,
                         scaled_orthogonalize_fn=scaled_orthogonalize_fn)


# ------------------------------------------------------------------ MuonHyperball
class MuonHyperball(Muon):
    """Muon whose weights stay on the Frobenius sphere of radius R: the update is rescaled to
    norm R (pre hook), the updated weight back to norm R (post hook), both norms floored at
    ``hyperball_eps``. Construction: ValueError for a parameter of norm <= eps, or one whose norm
    is not R to rtol 1e-5."""

    def __init__(self, *args, hyperball_radius, hyperball_eps=1e-15, **kwargs):
        self.hyperball_eps = hyperball_eps
        self.hyperball_radius = hyperball_radius
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    norm = float(p.norm())
                    if norm <= hyperball_eps:
                        raise ValueError("MuonHyperball requires all parameters to have non-zero norm.")
                    if abs(norm - hyperball_radius) > 1e-5 * abs(hyperball_radius):
                        raise ValueError(f"hyperball_radius={hyperball_radius} was specified but a parameter "
                                         f"has Frobenius norm {norm}.")

    def pre_weight_update_fn_inplace(self, p, update):
        update.mul_(self.hyperball_radius / update.norm().clamp_min(self.hyperball_eps))

    def post_weight_update_fn_inplace(self, p):
        p.mul_(self.hyperball_radius / p.norm().clamp_min(self.hyperball_eps))


# ------------------------------------------------------------------ PolarGrad
class PolarGrad(OrthogonalizedOptimizer):
    """NS(momentum) · <NS(momentum), momentum> (a nuclear-norm estimate) · extra_scale_factor.
    num_ns_steps = 0 is allowed (then the update is the momentum itself); < 0 is a ValueError."""

    def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.01, *, nesterov=False,
                 weight_decay_method="decoupled", fp32_matmul_prec="highest", coefficient_type="quintic",
                 num_ns_steps=5, extra_scale_factor=1.0):
        if num_ns_steps < 0:
            raise ValueError(f"num_ns_steps must be positive, got {num_ns_steps}")

        def scaled_orthogonalize_fn(grad):
            out = _ns(grad, num_ns_steps, coefficient_type)
            return out * ((out * grad).sum() * extra_scale_factor)

        super().__init__(params, lr, momentum, weight_decay, nesterov=nesterov,
                         weight_decay_method=weight_decay_method, fp32_matmul_prec=fp32_matmul_prec,
                         scaled_orthogonalize_fn=scaled_orthogonalize_fn)


def one_sided_polargrad_orth_fn(grad, *, side, alpha=1.0, center_rows=False, eps=1e-15, extra_scale_factor=1.0):
    """One polar factor by eigendecomposition of the Gram matrix (G Gᵀ for "left", Gᵀ G for
    "right"): eigenvalues floored at eps; those at or below max·n·eps(float32) (EO works in
    float32 and uses its epsilon) get a zero inverse square root. Update: factor ·
    (sum of sqrt(eigenvalues))^alpha · extra_scale_factor. center_rows subtracts the column means
    before and after. ValueError for another side."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    m = grad.to(torch.float64)
    if center_rows:
        m = m - m.mean(dim=0, keepdim=True)
    gram = m @ m.mT if side == "left" else m.mT @ m
    lam, vec = torch.linalg.eigh(gram)
    lam = lam.clamp_min(eps)
    cutoff = lam.max() * gram.shape[-1] * torch.finfo(torch.float32).eps
    inv_sqrt = torch.where(lam > cutoff, lam.rsqrt(), torch.zeros_like(lam))
    root = (vec * inv_sqrt.unsqueeze(-2)) @ vec.mT
    factor = root @ m if side == "left" else m @ root
    update = factor * lam.sqrt().sum().pow(alpha) * extra_scale_factor
    if center_rows:
        update = update - update.mean(dim=0, keepdim=True)
    return update


def right_polargrad_orth_fn(grad, *, alpha=1.0, center_rows=False, eps=1e-15, extra_scale_factor=1.0):
    return one_sided_polargrad_orth_fn(grad, side="right", alpha=alpha, center_rows=center_rows, eps=eps,
                                       extra_scale_factor=extra_scale_factor)


def left_polargrad_orth_fn(grad, *, alpha=1.0, center_rows=False, eps=1e-15, extra_scale_factor=1.0):
    return one_sided_polargrad_orth_fn(grad, side="left", alpha=alpha, center_rows=center_rows, eps=eps,
                                       extra_scale_factor=extra_scale_factor)


# ------------------------------------------------------------------ Spel
class Spel(OrthogonalizedOptimizer):
    """p <- NS(decayed p - lr · NS(momentum)): the unscaled NS is the update, and the post hook
    replaces the weight by NS of itself (same steps and coefficients)."""

    def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.1, *, nesterov=False,
                 weight_decay_method="decoupled", fp32_matmul_prec="medium", coefficient_type="quintic",
                 num_ns_steps=5):
        if num_ns_steps < 1:
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        super().__init__(params, lr, momentum, weight_decay, nesterov=nesterov,
                         weight_decay_method=weight_decay_method, fp32_matmul_prec=fp32_matmul_prec,
                         scaled_orthogonalize_fn=lambda x: _ns(x, num_ns_steps, coefficient_type))

    def post_weight_update_fn_inplace(self, p):
        p.copy_(self.scaled_orthogonalize_fn(p))


# ------------------------------------------------------------------ Muown (EO contrib)
class Muown(Muon):
    """Each row of W as magnitude g (per row, Adam) times direction v (Muon).

    State per 2-D parameter, created at its first step: ``step`` (int, 0), ``g`` and ``v_norm``
    (the row norms of W floored at 1e-12, shape (rows, 1)), ``momentum_buffer`` (like W),
    ``m_g``, ``v_g`` (zeros like g). EO keeps all of them in float32; here float32 for a float32
    parameter and float64 otherwise. A parameter that is not 2-D is a TypeError there.

    Step, t = step + 1: u = W / g; v = u · v_norm; grad_g = rowsum(grad · u);
    grad_v = (g / v_norm) · (grad - u · grad_g); momentum <- EMA(grad_v); v' = v - lr · Muon
    direction of the momentum; g -= lr · Adam(grad_g; betas, adam_eps, bias-corrected at t);
    g *= 1 - lr · wd (when wd != 0); W = g · v' / ||v'||_row; v_norm = ||v'||_row.
    No weight-update hooks and no orthogonalize() call: Muon's function is used directly.
    """

    def __init__(self, params, lr=3e-4, momentum=0.95, weight_decay=0.0, *, betas=(0.9, 0.95), adam_eps=1e-8,
                 fp32_matmul_prec="medium", coefficient_type="quintic", num_ns_steps=5, scale_mode="spectral",
                 extra_scale_factor=1.0, use_syrk=False):
        self.betas = betas
        self.adam_eps = adam_eps
        super().__init__(params, lr, momentum, weight_decay, nesterov=False, weight_decay_method="decoupled",
                         fp32_matmul_prec=fp32_matmul_prec, coefficient_type=coefficient_type,
                         num_ns_steps=num_ns_steps, scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                         use_syrk=use_syrk)

    @torch.no_grad()
    def _init_group(self, group, skip_non_grad_params=True):
        for p in group["params"]:
            if p.grad is None and skip_non_grad_params:
                continue
            if p.dim() != 2:
                raise TypeError("Muown is only supported for 2D parameters")
            state = self.state[p]
            if state:
                continue
            dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
            rows = p.norm(dim=1, keepdim=True).to(dtype).clamp_min(1e-12)
            state["step"] = 0
            state["g"] = rows.clone()
            state["v_norm"] = rows.clone()
            state["momentum_buffer"] = torch.zeros(p.shape, dtype=dtype, device=p.device)
            state["m_g"] = torch.zeros_like(rows)
            state["v_g"] = torch.zeros_like(rows)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure is not supported")
        beta1, beta2 = self.betas
        for group in self.param_groups:
            self._init_group(group)
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                t = s["step"] + 1
                g, v_norm = s["g"], s["v_norm"]
                W, grad = p.to(g.dtype), p.grad.to(g.dtype)
                u = W / g
                v = u * v_norm
                grad_g = (grad * u).sum(dim=1, keepdim=True)
                grad_v = (g / v_norm) * (grad - u * grad_g)
                s["momentum_buffer"].lerp_(grad_v, 1 - group["momentum"])
                v_new = v - lr * self.scaled_orthogonalize_fn(s["momentum_buffer"])
                s["m_g"].lerp_(grad_g, 1 - beta1)
                s["v_g"].lerp_(grad_g.square(), 1 - beta2)
                m_hat = s["m_g"] / (1 - beta1**t)
                v_hat = s["v_g"] / (1 - beta2**t)
                g.sub_(lr * m_hat / (v_hat.sqrt() + self.adam_eps))
                self._apply_weight_decay_inplace(g, grad_g, lr, wd)
                rows = v_new.norm(dim=1, keepdim=True)
                p.copy_(g * (v_new / rows))
                s["v_norm"] = rows
                s["step"] = t
        return None


# ------------------------------------------------------------------ spectral clipping
def spectral_clip(X, sigma_min=-1.0, sigma_max=1.0):
    """Singular values clipped to [sigma_min, sigma_max] through matrix signs (8 polar_express
    NS steps each), on the wide orientation: with O = msign(X),
    ½[(lo + hi) O + msign(lo I - O Xᵀ)(lo O - X) - msign(hi I - O Xᵀ)(hi O - X)]."""
    X = X.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    O = _ns(X, 8, "polar_express")
    eye = torch.eye(X.shape[0], dtype=X.dtype)
    out = (sigma_min + sigma_max) * O
    for s, sign in ((sigma_min, 1.0), (sigma_max, -1.0)):
        out = out + sign * _ns(s * eye - O @ X.T, 8, "polar_express") @ (s * O - X)
    out = 0.5 * out
    return out.T if tall else out


def spectral_hardcap(X, beta=1.0):
    """Singular values capped at beta: with O = msign(X), D = beta O - X,
    ½[(beta O + X) - D msign(D)ᵀ O] (polar_express, 8 steps, wide orientation)."""
    X = X.double()
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    O = _ns(X, 8, "polar_express")
    D = beta * O - X
    out = 0.5 * ((beta * O + X) - D @ (_ns(D, 8, "polar_express").T @ O))
    return out.T if tall else out


def spectral_clipped_weight_decay(X, beta=1.0, c=0.5):
    """(1 - c) X + c · spectral_hardcap(X, beta)."""
    return (1 - c) * X.double() + c * spectral_hardcap(X, beta)


# ------------------------------------------------------------------ EO's class registry
class Registry:
    """EO's module-level registry as an object: names are lower-cased on the way in and out."""

    def __init__(self):
        self._classes: dict[str, type] = {}

    def register_optimizer(self, name):
        def decorator(cls):
            if name.lower() in self._classes:
                raise ValueError(f"Optimizer {name} already registered.")
            self._classes[name.lower()] = cls
            return cls

        return decorator

    def get_optimizer_name_list(self):
        return list(self._classes)

    def get_optimizer_cls(self, name):
        if name.lower() not in self._classes:
            raise ValueError(f"Optimizer {name} not found in the registry.")
        return self._classes[name.lower()]

    @staticmethod
    def validate_optimizer_args(opt_cls, kwargs):
        """TypeError naming the keywords (``params`` aside) the class's signature lacks."""
        supported = set(inspect.signature(opt_cls).parameters)
        unknown = set(kwargs) - supported - {"params"}
        if unknown:
            raise TypeError(f"Optimizer '{opt_cls.__name__}' does not accept arguments: {unknown}.\n"
                            f"Valid options are: {list(supported)}")

    def get_configured_optimizer_cls(self, name, **kwargs):
        cls = self.get_optimizer_cls(name)
        self.validate_optimizer_args(cls, kwargs)
        return partial(cls, **kwargs)


# The orthogonalized family's registry names in 0.4.0 (Muown, in contrib, is not registered).
FAMILY_NAMES = {"muon": Muon, "adaptive_muon": AdaptiveMuon, "scion": Scion, "mop": MOP,
                "muon_hyperball": MuonHyperball, "polargrad": PolarGrad, "spel": Spel}
# Everything else 0.4.0 registers, for the record (none of it is implemented here or in the package).
OTHER_NAMES = ("kl_soap_v3", "kl_m_soap", "psgd_pro", "iso", "oblique_sgd", "oblique_adam", "lion", "signum",
               "laprop", "sim_ademamix", "moso", "rekls", "soap", "stacked_soap", "tp_rekls")


def family_registry() -> Registry:
    registry = Registry()
    for name, cls in FAMILY_NAMES.items():
        registry.register_optimizer(name)(cls)
    return registry


CLASSES: dict[str, Callable[..., Any]] = {
    "OrthogonalizedOptimizer": OrthogonalizedOptimizer, "Muon": Muon, "AdaptiveMuon": AdaptiveMuon,
    "Scion": Scion, "MOP": MOP, "MuonHyperball": MuonHyperball, "PolarGrad": PolarGrad, "Spel": Spel,
    "Muown": Muown,
}
