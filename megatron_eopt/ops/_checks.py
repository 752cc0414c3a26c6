"""Argument checks shared by the op families: Python exceptions naming the argument before an op
runs, and the checks of the fake kernels (register_fake) that torch.compile traces."""

from __future__ import annotations

import math
import struct
from typing import Sequence, Union

import torch

from .. import _library  # noqa: F401  (loads the op library)
from ._constants import WEIGHT_DECAY_METHODS

_ops = torch.ops.megatron_eopt

ScalarArg = Union[float, torch.Tensor]


def _tensor_list(name: str, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(xs).__name__}")
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
    return list(xs)


# ------------------------------------------------------------------ per-step scalars
def _step_scalar(name: str, value: ScalarArg, device: torch.device, check=None) -> torch.Tensor:
    """A per-step scalar as the ops take it: a 0-dim fp32 or fp64 tensor on the lists' device.

    Tensors pass through unchanged (the op checks dtype and device; reading their value would
    synchronize, so a device tensor's value is the caller's to keep valid). Python numbers are
    checked with ``check(value) -> message | None`` and become a fresh fp64 tensor, filled on the
    device without a host sync; fp64 keeps the reference's rounding of e.g. ``1 - momentum``.
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float or a 0-dim float32/float64 tensor, got {type(value).__name__}")
    value = float(value)
    problem = check(value) if check is not None else (None if math.isfinite(value) else "must be finite")
    if problem is not None:
        raise ValueError(f"{name} {problem}, got {value}")
    return torch.full((), value, dtype=torch.float64, device=device)


def _optional_scalar(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be None or a 0-dim tensor (GradScaler's), got {type(value).__name__}")
    return value


def _float32_value(value: float) -> float:
    """value as stored in fp32 (inf when out of range, 0 when below the smallest subnormal)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_unit_interval(value: float) -> str | None:
    return None if 0.0 <= value <= 1.0 else "must be finite and in [0, 1]"


def _check_momentum(value: float) -> str | None:
    # Any finite value >= 0 (torch.optim.Muon accepts momentum >= 1; the optimizers check their own range).
    return None if 0.0 <= value < math.inf else "must be finite and >= 0"


def _check_eps(value: float) -> str | None:
    # The kernels use eps in fp32: a value that rounds to 0 or inf there is refused here.
    return None if 0.0 < _float32_value(value) < math.inf else "must be finite and positive in float32"


def _moment2_scalars(device, beta2, eps) -> tuple[torch.Tensor, torch.Tensor]:
    return (_step_scalar("beta2", beta2, device, _check_unit_interval), _step_scalar("eps", eps, device, _check_eps))


def _check_matrix(name: str, x: torch.Tensor, ranks: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.ndim not in ranks:
        raise TypeError(f"{name} must be {' or '.join(f'{r}-D' for r in ranks)}, got {x.ndim}-D")


def _check_weight_decay_method(method: str) -> None:
    if method not in WEIGHT_DECAY_METHODS:
        raise ValueError(f"unknown weight_decay_method {method!r}, expected one of: {', '.join(WEIGHT_DECAY_METHODS)}")



# ------------------------------------------------------------------ fake kernels
def _fake_list_dtype(op: str, name: str, xs, allowed) -> torch.dtype | None:
    dtype = None
    for i, x in enumerate(xs):
        torch._check_type(x.dtype in allowed, lambda: f"{op}: {name}[{i}] is {x.dtype}; expected one of {allowed}")
        dtype = dtype or x.dtype
        torch._check_type(x.dtype == dtype, lambda: f"{op}: all {name} must share one dtype")
    return dtype


def _fake_check_index(op: str, i: int, ref_name: str, ref: torch.Tensor, others) -> None:
    for name, xs in others:
        if len(xs) > 0:
            torch._check_value(xs[i].shape == ref.shape,
                               lambda: f"{op}: {name}[{i}] has shape {tuple(xs[i].shape)} but {ref_name}[{i}] "
                                       f"has shape {tuple(ref.shape)}")


def _fake_check_scalar(op: str, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    torch._check_value(t.dim() == 0, lambda: f"{op}: {name} must be a 0-dim float32 or float64 tensor")
    torch._check_type(t.dtype in (torch.float32, torch.float64),
                      lambda: f"{op}: {name} must be a 0-dim float32 or float64 tensor")
