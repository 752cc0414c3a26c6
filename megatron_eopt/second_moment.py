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


def moment2_state_shape(method: str, param_shape: Sequence[int], view_shape: Sequence[int],
                        normuon_dim: int) -> tuple[int, ...]:
    """The stored second-moment state of a parameter whose matrix view is ``view_shape``: adamuon
    shaped like the parameter; normuon / namo as :func:`moment2_view_shape`, except that an
    ``nd_mode="batch"`` parameter of more than three dims keeps its own leading dims ((A, B, m, n)
    -> (A, B, m, 1), not (A * B, m, 1)), so a state sharded like its parameter on dim 0 holds each
    rank's matrices in its own rows. :func:`moment2_view` gives the step's view of it."""
    if method == "adamuon":
        return tuple(param_shape)
    shape = moment2_view_shape(method, view_shape, normuon_dim)
    if len(param_shape) > 3 and len(view_shape) == 3:
        return tuple(param_shape[:-2]) + shape[1:]
    return shape


def moment2_view(state, method: str, view_ndim: int):
    """The normuon / namo state as the step reads it: one row per matrix of a (E, m, n) view
    ((E, m, 1) / (E, 1, n) / (E, 1)); a state with more leading dims (:func:`moment2_state_shape`)
    has them flattened (a view)."""
    want = view_ndim if method == "normuon" else view_ndim - 1
    if state.dim() <= want or view_ndim != 3:
        return state
    return state.flatten(0, state.dim() - want)
