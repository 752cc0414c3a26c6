"""Second-moment state of the AdaptiveMuon family (AdaMuon, NorMuon, NAMO).

Pure Python (no compiled code needed): the shape rules the normalization ops check against,
as Emerging-Optimizers 0.3.0's ``AdaptiveMuon`` creates its ``moment2_buffer``.
"""

from __future__ import annotations

from typing import Literal, Sequence, get_args

Moment2MethodT = Literal["adamuon", "normuon", "namo"]
MOMENT2_METHODS: tuple[str, ...] = get_args(Moment2MethodT)


def validate_moment2_method(method: str) -> None:
    """Raises ValueError naming the supported methods when ``method`` is unknown."""
    if method not in MOMENT2_METHODS:
        raise ValueError(f"moment2_method must be one of {list(MOMENT2_METHODS)}, got {method!r}")


def moment2_shape(method: Moment2MethodT, m: int, n: int) -> tuple[int, ...]:
    """Shape of the (fp32) second-moment state of an ``(m, n)`` parameter.

    adamuon: ``(m, n)`` (elementwise); normuon: ``(m, 1)`` when ``m >= n`` else ``(1, n)`` (the mean
    is taken over the shorter side); namo: ``(1,)`` (a scalar EMA of the squared gradient norm).
    """
    validate_moment2_method(method)
    if m < 0 or n < 0:
        raise ValueError(f"m and n must be non-negative, got ({m}, {n})")
    return moment2_view_shape(method, (m, n), -1 if m >= n else -2)


def moment2_view_shape(method: str, view_shape: Sequence[int], normuon_dim: int) -> tuple[int, ...]:
    """The second-moment state of a matrix view ``(..., m, n)`` (leading dims: an ``nd_mode="batch"``
    stack of matrices): adamuon shaped like the view, normuon with 1 on ``normuon_dim`` (the side
    the mean is taken over, chosen from the global shape), namo one scalar per matrix ``(..., 1)``."""
    if method == "adamuon":
        return tuple(view_shape)
    if method == "normuon":
        shape = list(view_shape)
        shape[normuon_dim] = 1
        return tuple(shape)
    return tuple(view_shape[:-2]) + (1,)
