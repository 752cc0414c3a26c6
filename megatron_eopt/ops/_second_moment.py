"""Second-moment normalization of the AdaptiveMuon family (AdaMuon, NorMuon, NAMO): wrappers and fake kernels."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._errors import call_op
from ..second_moment import Moment2MethodT, moment2_shape, validate_moment2_method
from ._checks import ScalarArg, _check_matrix, _fake_check_scalar, _moment2_scalars, _ops, _optional_scalar, _tensor_list

_MOMENT2_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_moment2_lists(method: str, updates, moment2, grads=None, ns_inputs=None):
    updates = _tensor_list("updates", updates)
    moment2 = _tensor_list("moment2", moment2)
    if len(moment2) != len(updates):
        raise ValueError(f"moment2 has {len(moment2)} tensors but updates has {len(updates)}")
    extra = {}
    if method == "namo":
        extra = {"grads": _tensor_list("grads", grads), "ns_inputs": _tensor_list("ns_inputs", ns_inputs)}
        for name, xs in extra.items():
            if len(xs) != len(updates):
                raise ValueError(f"{name} has {len(xs)} tensors but updates has {len(updates)}")
    for i, (u, v) in enumerate(zip(updates, moment2)):
        _check_matrix(f"updates[{i}]", u, (2,))
        if u.device != updates[0].device:
            raise ValueError(f"updates[{i}] is on {u.device} but updates[0] is on {updates[0].device}")
        if v.dtype != torch.float32:
            raise TypeError(f"moment2[{i}] must be float32, got {v.dtype}")
        if v.device != u.device:
            raise ValueError(f"moment2[{i}] is on {v.device} but updates[{i}] is on {u.device}")
        expected = moment2_shape(method, u.shape[0], u.shape[1])
        if tuple(v.shape) != expected and not (method == "namo" and v.dim() == 0):
            raise ValueError(
                f"moment2[{i}] has shape {tuple(v.shape)} but an update of shape {tuple(u.shape)} needs {expected}"
            )
        for name, xs in extra.items():
            x = xs[i]
            if x.dtype not in _MOMENT2_INPUT_DTYPES:
                raise TypeError(f"{name}[{i}] must be float32, bfloat16 or float16, got {x.dtype}")
            if x.shape != u.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(x.shape)} but updates[{i}] has shape {tuple(u.shape)}")
            if x.device != u.device:
                raise ValueError(f"{name}[{i}] is on {x.device} but updates[{i}] is on {u.device}")
    return updates, moment2, extra


def _row_normalize(name: str, op: Any, updates: Sequence[torch.Tensor], moment2: Sequence[torch.Tensor],
                   beta2: ScalarArg, eps: ScalarArg, found_inf: torch.Tensor | None) -> None:
    """Checks the lists and scalars of ``adamuon`` / ``normuon`` and runs ``op`` on them."""
    updates, moment2, _ = _check_moment2_lists(name, updates, moment2)
    if updates:
        b, e = _moment2_scalars(updates[0].device, beta2, eps)
        call_op(op, updates, moment2, b, e, _optional_scalar("found_inf", found_inf))


def adamuon_normalize_(
    updates: Sequence[torch.Tensor],
    moment2: Sequence[torch.Tensor],
    *,
    beta2: ScalarArg = 0.95,
    eps: ScalarArg = 1e-8,
    found_inf: torch.Tensor | None = None,
) -> None:
    """AdaMuon, in place on each raw Newton–Schulz output ``O = updates[i]`` (fp32, 2-D).

    ``v <- beta2 v + (1 - beta2) O**2`` elementwise (``v = moment2[i]``, fp32, shaped like ``O``), then
    ``O <- O / (sqrt(v) + eps)``. No bias correction. Apply the Muon scale afterwards. ``beta2`` and
    ``eps`` are floats or 0-dim tensors on the lists' device; a non-zero ``found_inf`` (GradScaler)
    leaves everything untouched.
    """
    _row_normalize("adamuon", _ops.adamuon_normalize_, updates, moment2, beta2, eps, found_inf)


def normuon_normalize_(
    updates: Sequence[torch.Tensor],
    moment2: Sequence[torch.Tensor],
    *,
    beta2: ScalarArg = 0.95,
    eps: ScalarArg = 1e-8,
    found_inf: torch.Tensor | None = None,
) -> None:
    """NorMuon, in place on each raw Newton–Schulz output ``O = updates[i]`` (fp32, ``(m, n)``).

    ``v = moment2[i]`` is ``(m, 1)`` when ``m >= n`` else ``(1, n)``: ``v <- beta2 v + (1 - beta2) r``
    with ``r`` the mean of ``O**2`` over the shorter side; ``U' = O * rsqrt(max(v, eps))``;
    ``O <- U' * ||O||_F / max(||U'||_F, eps)``. Scalars as in :func:`adamuon_normalize_`.
    """
    _row_normalize("normuon", _ops.normuon_normalize_, updates, moment2, beta2, eps, found_inf)


def namo_normalize_(
    updates: Sequence[torch.Tensor],
    moment2: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    ns_inputs: Sequence[torch.Tensor],
    *,
    beta2: ScalarArg = 0.95,
    eps: ScalarArg = 1e-8,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """NAMO, in place on each raw Newton–Schulz output ``O = updates[i]`` (fp32, 2-D).

    ``v = moment2[i]`` is a ``(1,)`` fp32 tensor: ``v <- beta2 v + (1 - beta2) ||grads[i]||_F**2``, then
    ``O <- O * ||ns_inputs[i]||_F / (sqrt(v) + eps)``. ``grads[i]`` is the gradient (after weight decay;
    divided by ``grad_scale`` when given), ``ns_inputs[i]`` the Newton–Schulz input (momentum /
    Nesterov output); both shaped like ``O``, float32, bfloat16 or float16. Scalars as in
    :func:`adamuon_normalize_`.
    """
    updates, moment2, extra = _check_moment2_lists("namo", updates, moment2, grads, ns_inputs)
    if updates:
        b, e = _moment2_scalars(updates[0].device, beta2, eps)
        call_op(_ops.namo_normalize_, updates, moment2, extra["grads"], extra["ns_inputs"], b, e,
                             _optional_scalar("grad_scale", grad_scale), _optional_scalar("found_inf", found_inf))


def new_moment2_buffer(method: Moment2MethodT, param: torch.Tensor) -> torch.Tensor:
    """Zero second-moment state (fp32, on ``param``'s device) of a 2-D parameter for ``method``."""
    validate_moment2_method(method)
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    if param.dim() != 2:
        raise ValueError(f"param must be 2-D, got shape {tuple(param.shape)}")
    return torch.zeros(moment2_shape(method, param.shape[0], param.shape[1]), dtype=torch.float32, device=param.device)



# ------------------------------------------------------------------ fake kernels
def _moment2_fake_checks(updates, moment2):
    torch._check(len(moment2) == len(updates), lambda: "moment2 and updates differ in length")
    for u, v in zip(updates, moment2):
        torch._check(u.dtype == torch.float32 and u.dim() == 2, lambda: "updates must be 2-D float32")
        torch._check(v.dtype == torch.float32, lambda: "moment2 must be float32")


@torch.library.register_fake("megatron_eopt::adamuon_normalize_")
def _adamuon_normalize_fake(updates, moment2, beta2, eps, found_inf=None):
    _moment2_fake_checks(updates, moment2)
    _fake_check_scalar("adamuon_normalize_", "beta2", beta2)
    _fake_check_scalar("adamuon_normalize_", "eps", eps)


@torch.library.register_fake("megatron_eopt::normuon_normalize_")
def _normuon_normalize_fake(updates, moment2, beta2, eps, found_inf=None):
    _moment2_fake_checks(updates, moment2)
    _fake_check_scalar("normuon_normalize_", "beta2", beta2)
    _fake_check_scalar("normuon_normalize_", "eps", eps)


@torch.library.register_fake("megatron_eopt::namo_normalize_")
def _namo_normalize_fake(updates, moment2, grads, ns_inputs, beta2, eps, grad_scale=None, found_inf=None):
    _moment2_fake_checks(updates, moment2)
    torch._check(len(grads) == len(updates) and len(ns_inputs) == len(updates),
                 lambda: "grads, ns_inputs and updates differ in length")
    _fake_check_scalar("namo_normalize_", "beta2", beta2)
    _fake_check_scalar("namo_normalize_", "eps", eps)

