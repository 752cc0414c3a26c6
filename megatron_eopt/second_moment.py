"""Second-moment state of the AdaptiveMuon family (AdaMuon, NorMuon, NAMO).

Pure Python (no compiled code needed): the shape rules the normalization ops check against,
as Emerging-Optimizers 0.3.0's ``AdaptiveMuon`` creates its ``moment2_buffer``.
"""

from __future__ import annotations

from typing import Literal, get_args

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
    if method == "adamuon":
        return (m, n)
    if method == "normuon":
        return (m, 1) if m >= n else (1, n)
    return (1,)
