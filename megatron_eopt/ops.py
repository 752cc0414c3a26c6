"""Typed Python wrappers over ``torch.ops.megatron_eopt`` and the fake kernel of every op.

The wrappers validate arguments with Python exceptions (TypeError / ValueError naming the
argument) before anything runs; the ops check again in C++ for direct callers.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import _library  # noqa: F401  (loads the op library)
from .newton_schulz import NSCoeffT, PrecisionT, coefficient_table, validate_precision

_ops = torch.ops.megatron_eopt


def _flatten(rows: Sequence[Sequence[float]]) -> list[float]:
    return [float(v) for row in rows for v in row]


def _ns_arguments(
    steps: int,
    coefficient_type: str,
    custom_coefficient_sets: Sequence[Sequence[float]] | None,
    eps: float,
    precision: str,
) -> tuple[list[float], bool]:
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    validate_precision(precision)
    table, repeat_last = coefficient_table(coefficient_type, custom_coefficient_sets)
    return _flatten(table), repeat_last


def _check_matrix(name: str, x: torch.Tensor, ranks: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.ndim not in ranks:
        raise TypeError(f"{name} must be {' or '.join(f'{r}-D' for r in ranks)}, got {x.ndim}-D")


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficient_type: NSCoeffT = "quintic",
    custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
    eps: float = 1e-7,
    transpose: bool | None = None,
    precision: PrecisionT = "medium",
) -> torch.Tensor:
    """Orthogonalizes ``x`` (fp32, ``(m, n)`` or ``(batch, m, n)``) by Newton–Schulz iteration.

    Each matrix is normalized by its Frobenius norm (clamped to ``eps``), then ``steps`` rows of
    the coefficient schedule are applied in the compute ``precision`` ("medium": bf16 storage with
    fp32 accumulation, "high": TF32, "highest": fp32). Tall matrices are iterated transposed unless
    ``transpose`` says otherwise. Returns an fp32 tensor shaped like ``x``.
    """
    _check_matrix("x", x, (2, 3))
    coefficients, repeat_last = _ns_arguments(steps, coefficient_type, custom_coefficient_sets, eps, precision)
    return _ops.newton_schulz(x, coefficients, steps, repeat_last, eps, transpose, precision)


def newton_schulz_list(
    xs: Sequence[torch.Tensor],
    steps: int = 5,
    coefficient_type: NSCoeffT = "quintic",
    custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
    eps: float = 1e-7,
    transpose: bool | None = None,
    precision: PrecisionT = "medium",
) -> list[torch.Tensor]:
    """:func:`newton_schulz` of each 2-D matrix of ``xs``; equal shapes run as one batch."""
    for i, x in enumerate(xs):
        _check_matrix(f"xs[{i}]", x, (2,))
    if len(xs) == 0:
        return []
    coefficients, repeat_last = _ns_arguments(steps, coefficient_type, custom_coefficient_sets, eps, precision)
    return list(_ops.newton_schulz_list(list(xs), coefficients, steps, repeat_last, eps, transpose, precision))


# ------------------------------------------------------------------ fake kernels
@torch.library.register_fake("megatron_eopt::newton_schulz")
def _newton_schulz_fake(x, coefficients, steps, repeat_last, eps, transpose, precision):
    torch._check(x.dtype == torch.float32, lambda: f"x must be float32, got {x.dtype}")
    torch._check(x.dim() in (2, 3), lambda: f"x must be 2-D or 3-D, got {x.dim()}-D")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_eopt::newton_schulz_list")
def _newton_schulz_list_fake(xs, coefficients, steps, repeat_last, eps, transpose, precision):
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
