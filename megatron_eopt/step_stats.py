"""What one optimizer step did on this rank: Newton–Schulz work and communication.

Every orthogonalizing optimizer of the package reports its last step through ``step_stats()``
(:class:`StepStatsReporter`): the matrices it orthogonalized, its share of the Newton–Schulz
FLOPs, the collectives it called and the bytes it sent, and the host time of the step. The
counts come from the places that do the work: the Newton–Schulz calls of the optimizers and
:mod:`megatron_eopt.ops`, and the collectives of :mod:`megatron_eopt._collectives`, while a step
records (:func:`records_step_stats`). Nothing is synchronized for them and no tensor is read.

Conventions (the planner, ``megatron_eopt.plan``, counts by the same rules):

- ``ns_matrices``: matrices this rank orthogonalized whole (a fused QKV projection split into
  parts counts once; an expert batch of E counts E).
- ``ns_shared_matrices``: matrices orthogonalized jointly with other ranks (tensor-parallel
  ``tp_mode="distributed"``: every rank of the group iterates on its shard; there a fused QKV
  projection counts once per part, each part being iterated on its own).
- ``ns_flops``: this rank's Newton–Schulz FLOPs by the model ``steps · s²(4l + 2s)`` for an
  (s, l) matrix, s the short side; a shared matrix counts its share, the total over the group.
- ``collectives``: calls of a collective (a relay hop counts as one call, an all-gather of
  an object as one).
- ``bytes_sent``: bytes this rank sends to other ranks under the textbook algorithm of each
  collective, whatever the backend really does: all-gather (p − 1)·local; reduce-scatter
  (p − 1)·output; all-reduce ⌊2(p − 1)·size / p⌋ (ring); all-to-all what its splits send to
  other ranks; a DTensor gather (p − 1)·local per sharded mesh dim.
- ``agreements``, ``agreement_bytes``: of those collectives and bytes, the ranks' agreement before
  the step (``multirank.agreement``: one all-reduce per mesh dim where matrices span ranks; with
  ``overlap_backward`` one more per chunk whose work communicates).
- ``seconds_in_step``: host wall time of ``step()``. On CUDA it is the time to enqueue the step's
  work unless something in it waits for the device.
- ``seconds_before_step``: host time of work started before ``step()`` (None: none was).

Under ``torch.compile`` nothing is recorded: a compiled step keeps the previous step's figures.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch


@dataclass(eq=False)  # recorders are told apart by identity
class StepStats:
    """The counters of one step on one rank (see the module docstring for each)."""

    ns_matrices: int = 0
    ns_shared_matrices: int = 0
    ns_flops: float = 0.0
    collectives: int = 0
    bytes_sent: int = 0
    agreements: int = 0
    agreement_bytes: int = 0
    seconds_in_step: float | None = None
    seconds_before_step: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_active = threading.local()


def _recorders() -> list[StepStats]:
    stack = getattr(_active, "stack", None)
    if stack is None:
        stack = _active.stack = []
    return stack


def _stack() -> list[StepStats] | None:
    """The recorders of this thread; None while compiling (a compiled step records nothing, and
    must not guard on this thread's state either)."""
    if torch.compiler.is_compiling():
        return None
    return getattr(_active, "stack", None)


def recording() -> bool:
    """Whether a step is being recorded on this thread."""
    return bool(_stack())


def newton_schulz_flops(m: int, n: int, steps: int, *, gram_dim: int | None = None,
                        symmetric_gram: bool = False) -> float:
    """The model's FLOPs of ``steps`` Newton–Schulz iterations on one (m, n) matrix: per iteration,
    with ``a`` the side of its Gram matrix and ``b`` the other, the Gram product (a² b multiply-adds),
    the polynomial's square of it (a³) and the product back (a² b), two FLOPs each. ``gram_dim``
    (0: rows, 1: columns): the dim whose Gram matrix is formed, by default the shorter (a tensor-
    parallel shard iterated jointly forms its whole dim's); ``symmetric_gram``: the two symmetric
    products at half their FLOPs (a symmetric kernel, Megatron-LM's ``use_syrk``)."""
    if gram_dim is None:
        a, b = min(m, n), max(m, n)
    elif gram_dim in (0, 1):
        a, b = (m, n) if gram_dim == 0 else (n, m)
    else:
        raise ValueError(f"gram_dim must be None, 0 or 1, got {gram_dim!r}")
    if symmetric_gram:
        return float(steps) * a * a * (3 * b + a)
    return float(steps) * a * a * (4 * b + 2 * a)


def count_newton_schulz(shape, steps: int, shared_over: int = 1) -> None:
    """Counts the Newton–Schulz of the matrices of ``shape`` (..., m, n) on this rank; with
    ``shared_over`` p > 1 they are shards of matrices iterated jointly by p ranks, and ``shape`` is
    the global matrices' (this rank counts 1/p of their FLOPs)."""
    stack = _stack()
    if not stack:
        return
    *lead, m, n = shape
    count = math.prod(lead)
    flops = count * newton_schulz_flops(m, n, steps) / shared_over
    for stats in stack:
        if shared_over > 1:
            stats.ns_shared_matrices += count
        else:
            stats.ns_matrices += count
        stats.ns_flops += flops


def count_split_newton_schulz(shape, sizes, num_groups: int, steps: int) -> None:
    """Counts the split Newton–Schulz of fused projections of ``shape`` (..., rows, n): each is one
    matrix, whose parts (``num_groups`` groups of each size in ``sizes``) are iterated apart."""
    stack = _stack()
    if not stack:
        return
    *lead, _, n = shape
    count = math.prod(lead)
    flops = count * sum(newton_schulz_flops(num_groups * s, n, steps) for s in sizes)
    for stats in stack:
        stats.ns_matrices += count
        stats.ns_flops += flops


def count_collective(bytes_sent: int) -> None:
    """Counts one collective call that sends ``bytes_sent`` bytes from this rank."""
    stack = _stack()
    if not stack:
        return
    for stats in stack:
        stats.collectives += 1
        stats.bytes_sent += int(bytes_sent)


def count_agreement(bytes_sent: int) -> None:
    """Marks the collective just counted (``bytes_sent``) as one of the ranks' agreement."""
    stack = _stack()
    if not stack:
        return
    for stats in stack:
        stats.agreements += 1
        stats.agreement_bytes += int(bytes_sent)


@contextlib.contextmanager
def recording_into(stats: StepStats):
    """Counts what this thread does inside the block into ``stats`` (work started before a step, on
    a thread of its own or in a backward hook: merged into the step by :func:`merge_into_recording`)."""
    stack = _recorders()
    stack.append(stats)
    try:
        yield stats
    finally:
        stack.remove(stats)


def merge_into_recording(parts: list[StepStats], seconds_before_step: float) -> None:
    """Adds the counts of work done before the step (``parts``) to the step being recorded on this
    thread, and the host time that work took as its ``seconds_before_step``."""
    stack = _stack()
    if not stack:
        return
    for stats in stack:
        for part in parts:
            for name in ("ns_matrices", "ns_shared_matrices", "ns_flops", "collectives", "bytes_sent", "agreements",
                         "agreement_bytes"):
                setattr(stats, name, getattr(stats, name) + getattr(part, name))
        stats.seconds_before_step = (stats.seconds_before_step or 0.0) + seconds_before_step


def records_step_stats(step: Callable) -> Callable:
    """Decorates an optimizer's step: what it does is counted into a new :class:`StepStats`, kept
    as the optimizer's last step's figures when the step returns (a step that raises keeps the
    previous ones). A step inside another's (an optimizer stepping its parts) counts into both."""

    @functools.wraps(step)
    def recorded(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return step(self, *args, **kwargs)
        stats = StepStats()
        stack = _recorders()
        stack.append(stats)
        start = time.perf_counter()
        try:
            out = step(self, *args, **kwargs)
        finally:
            stack.remove(stats)
        stats.seconds_in_step = time.perf_counter() - start
        self._last_step_stats = stats
        return out

    return recorded


class StepStatsReporter:
    """Mixin of the orthogonalizing optimizers: ``step_stats()``."""

    _last_step_stats: StepStats | None = None

    def step_stats(self) -> dict[str, Any]:
        """The counters of the last step on this rank (all zero before the first): ``ns_matrices``,
        ``ns_shared_matrices``, ``ns_flops``, ``collectives``, ``bytes_sent``, ``seconds_in_step``,
        ``seconds_before_step``. Conventions: :mod:`megatron_eopt.step_stats`. Sum ``ns_matrices``
        over the ranks of a group to see each matrix orthogonalized once (owner and layer-sharded
        modes) or on every rank (duplicated, gather)."""
        stats = self.__dict__.get("_last_step_stats")
        return (stats or StepStats()).as_dict()


__all__ = [
    "StepStats",
    "StepStatsReporter",
    "count_agreement",
    "count_collective",
    "count_newton_schulz",
    "count_split_newton_schulz",
    "newton_schulz_flops",
    "merge_into_recording",
    "records_step_stats",
    "recording",
    "recording_into",
]
