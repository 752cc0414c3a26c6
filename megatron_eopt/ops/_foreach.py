"""Momentum and update of the Muon family over lists of tensors (foreach ops): wrappers and fake kernels."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .._errors import call_op
from ._checks import (
    ScalarArg,
    _check_momentum,
    _check_weight_decay_method,
    _fake_check_index,
    _fake_check_scalar,
    _fake_list_dtype,
    _ops,
    _optional_scalar,
    _step_scalar,
    _tensor_list,
)
from ._constants import _FLOATS, _PARAM_FLOATS, WEIGHT_DECAY_METHODS


def _lists_device(*lists: Sequence[torch.Tensor]) -> torch.device | None:
    for xs in lists:
        if len(xs) > 0:
            return xs[0].device
    return None


def foreach_momentum_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    ns_inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    *,
    momentum: ScalarArg,
    nesterov: bool,
    weight_decay: ScalarArg = 0.0,
    weight_decay_method: str = "decoupled",
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """Momentum step of the Muon family over lists of tensors, in one fused pass per call.

    For each index i (math in fp32, results stored in each tensor's dtype): ``g = grads[i]``,
    divided by ``grad_scale`` when given (GradScaler; ``grads`` itself is not modified); with
    ``weight_decay_method == "l2"``, ``g = g + weight_decay * params[i]``; then
    ``momentum_buffers[i].lerp_(g, 1 - momentum)`` and ``ns_inputs[i]`` receives the Newton–Schulz
    input: ``g.lerp(momentum_buffers[i], momentum)`` with ``nesterov``, else the new buffer. A
    non-zero ``found_inf`` leaves every tensor untouched (decided on the device, no sync).

    ``params`` is read only for l2 and may be empty otherwise; the other weight-decay methods act
    on the parameters and are applied by :func:`foreach_update_`. Gradients and parameters are
    float32, bfloat16 or float16; buffers have their dtype or float32; ``ns_inputs`` are float32 or
    bfloat16 (e.g. slices of a stacked batch for :func:`newton_schulz`). Tensors of one index may
    have different layouts (a transposed parameter). ``momentum`` and ``weight_decay`` are floats
    or 0-dim tensors on the lists' device (optimizers pass tensors, so values that change every
    step neither sync nor recompile).
    """
    grads = _tensor_list("grads", grads)
    momentum_buffers = _tensor_list("momentum_buffers", momentum_buffers)
    ns_inputs = _tensor_list("ns_inputs", ns_inputs)
    params = _tensor_list("params", params)
    _check_weight_decay_method(weight_decay_method)
    device = _lists_device(grads, momentum_buffers, ns_inputs, params)
    if device is None:
        return
    mu = _step_scalar("momentum", momentum, device, _check_momentum)
    wd = _step_scalar("weight_decay", weight_decay, device)
    call_op(_ops.foreach_momentum_, grads, momentum_buffers, ns_inputs, params, mu, bool(nesterov), wd, weight_decay_method,
                           _optional_scalar("grad_scale", grad_scale), _optional_scalar("found_inf", found_inf))


def foreach_update_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    scales: Sequence[float],
    *,
    lr: ScalarArg,
    weight_decay: ScalarArg = 0.0,
    weight_decay_method: str = "decoupled",
    found_inf: torch.Tensor | None = None,
) -> None:
    """Weight decay and update of the parameters over lists of tensors, in one fused pass per call.

    For each index i: ``params[i] <- params[i] - f * params[i] - lr * scales[i] * updates[i]`` with
    ``f = lr * weight_decay`` (decoupled), ``weight_decay`` (independent), ``lr**2 * weight_decay``
    (palm) or 0 (l2: the decay went into the gradient in :func:`foreach_momentum_`); evaluated as
    the reference does, decay first (stored in the parameter's dtype), then the update, in fp32.
    ``"cautious"`` (Chen et al., "Cautious Weight Decay", 2025) is decoupled decay only where
    ``updates[i] * params[i] >= 0``, the mask read from the update as given (before its scale, so a
    scale of 0 applies the masked decay alone) and the parameter before the decay, with the
    numerics of ``p.sub_(p * (u * p >= 0) * f.to(p.dtype))`` in PyTorch.
    ``updates`` are float32 or the parameters' dtype; ``lr`` and ``weight_decay`` are floats or
    0-dim tensors (optimizers pass tensors, so a changing lr neither syncs nor recompiles). A
    non-zero ``found_inf`` leaves the parameters untouched.
    """
    params = _tensor_list("params", params)
    updates = _tensor_list("updates", updates)
    if isinstance(scales, torch.Tensor) or not isinstance(scales, (list, tuple)):
        raise TypeError(f"scales must be a list or tuple of floats, got {type(scales).__name__}")
    scale_values = []
    for i, s in enumerate(scales):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(f"scales[{i}] must be a float, got {type(s).__name__}")
        # Comparisons rather than math.isfinite: under torch.compile a float the step reads from a
        # plan may be traced as a symbol (dynamo's automatic dynamic floats), which the comparisons
        # guard on and math.isfinite cannot take. NaN fails both.
        if not -math.inf < s < math.inf:
            raise ValueError(f"scales[{i}] must be finite, got {s}")
        scale_values.append(float(s) if isinstance(s, int) else s)
    _check_weight_decay_method(weight_decay_method)
    device = _lists_device(params, updates)
    if device is None:
        if len(scale_values) != 0:
            raise ValueError(f"scales has {len(scale_values)} values but no params were given")
        return
    lr_t = _step_scalar("lr", lr, device)
    wd = _step_scalar("weight_decay", weight_decay, device)
    call_op(_ops.foreach_update_, params, updates, scale_values, lr_t, wd, weight_decay_method,
                         _optional_scalar("found_inf", found_inf))



# ------------------------------------------------------------------ fake kernels
@torch.library.register_fake("megatron_eopt::foreach_momentum_")
def _foreach_momentum_fake(grads, momentum_buffers, ns_inputs, params, momentum, nesterov, weight_decay,
                           weight_decay_method, grad_scale=None, found_inf=None):
    op = "foreach_momentum_"
    torch._check_value(weight_decay_method in WEIGHT_DECAY_METHODS,
                       lambda: f"{op}: unknown weight_decay_method {weight_decay_method!r}")
    n = len(grads)
    torch._check_value(len(momentum_buffers) == n and len(ns_inputs) == n, lambda: f"{op}: list lengths differ")
    torch._check_value(len(params) == n or (len(params) == 0 and weight_decay_method != "l2"),
                       lambda: f"{op}: params must be empty or have one tensor per gradient (l2: required)")
    grad_dtype = _fake_list_dtype(op, "grads", grads, _PARAM_FLOATS)
    if grad_dtype is not None:
        _fake_list_dtype(op, "params", params, (grad_dtype,))
        _fake_list_dtype(op, "momentum_buffers", momentum_buffers, tuple({grad_dtype, torch.float32}))
    _fake_list_dtype(op, "ns_inputs", ns_inputs, _FLOATS)
    for name, t in (("momentum", momentum), ("weight_decay", weight_decay), ("grad_scale", grad_scale),
                    ("found_inf", found_inf)):
        _fake_check_scalar(op, name, t)
    for i in range(n):
        _fake_check_index(op, i, "grads", grads[i],
                          (("momentum_buffers", momentum_buffers), ("ns_inputs", ns_inputs), ("params", params)))
    return None


@torch.library.register_fake("megatron_eopt::foreach_update_")
def _foreach_update_fake(params, updates, scales, lr, weight_decay, weight_decay_method, found_inf=None):
    op = "foreach_update_"
    torch._check_value(weight_decay_method in WEIGHT_DECAY_METHODS,
                       lambda: f"{op}: unknown weight_decay_method {weight_decay_method!r}")
    n = len(params)
    torch._check_value(len(updates) == n and len(scales) == n, lambda: f"{op}: list lengths differ")
    torch._check_value(all(math.isfinite(s) for s in scales), lambda: f"{op}: scales must be finite")
    param_dtype = _fake_list_dtype(op, "params", params, _PARAM_FLOATS)
    if param_dtype is not None:
        _fake_list_dtype(op, "updates", updates, tuple({param_dtype, torch.float32}))
    for name, t in (("lr", lr), ("weight_decay", weight_decay), ("found_inf", found_inf)):
        _fake_check_scalar(op, name, t)
    for i in range(n):
        _fake_check_index(op, i, "params", params[i], (("updates", updates),))
    return None

