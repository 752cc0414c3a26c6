"""Where a step's Newton–Schulz inputs lie, chunk by chunk: each stack's slice of its device's flat
fp32 buffer, the matrices with inputs of their own, and the buckets the chunk's members update.

Pure bookkeeping over the plan: it is the same every step in which the same parameters have a
gradient, so an eager step computes it once per such set and reuses it. On a small model the step
is host-bound (benchmarks/op_overhead.py), and this bookkeeping was a fifth of its Python time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..multirank.dtensor_layout import is_dtensor
from .grouping import Plan  # the plan holds this module's cache

# Each stack's NS input starts this many floats (256 bytes) into the flat buffer after the previous
# one, as a tensor of its own would be aligned: vectorized kernels and cuBLASLt see the same
# alignment as without the shared buffer.
STACK_ALIGN_FLOATS = 64


def aligned(floats: int) -> int:
    return -(-floats // STACK_ALIGN_FLOATS) * STACK_ALIGN_FLOATS


@dataclass(frozen=True)
class StackSlot:
    """One stack's part of a chunk: ``count`` (rows, cols) matrices from float ``start`` of the
    device's flat buffer; member j's matrices are ``firsts[j]`` onward (``batches[j]`` of them for
    an nd_mode "batch" entry, which gets a (batches[j], rows, cols) slice, possibly empty; None for
    a plain matrix, which gets its 2-D slice)."""

    stack_index: int
    device: torch.device
    start: int
    count: int
    rows: int
    cols: int
    members: tuple[int, ...]
    firsts: tuple[int, ...]
    batches: tuple[int | None, ...]


@dataclass(frozen=True)
class ChunkLayout:
    members: tuple[int, ...]  # the chunk's entries with a grad
    stacks: tuple[StackSlot, ...]  # in order of their first member
    own_inputs: tuple[int, ...]  # sharded matrices: an input of their own (not in a stack)
    floats: dict  # per device: the floats the chunk's stacks take in the flat buffer
    # per bucket used, in bucket order: (bucket index, its members in entry order, whether every
    # member's param is a plain tensor shaped as its local matrix view, so the param and grad serve
    # as they are)
    buckets: tuple[tuple[int, tuple[int, ...], bool], ...]
    chunk: int = -1  # the index of its chunk in the plan's chunks (-1: members of no chunk)


def chunk_layout(plan: Plan, members, chunk: int = -1) -> ChunkLayout:
    entries = plan.entries
    by_stack: dict[int, list[int]] = {}
    own = []
    for i in members:
        si = entries[i].stack_index
        if si >= 0:
            by_stack.setdefault(si, []).append(i)
        else:
            own.append(i)
    offsets: dict[torch.device, int] = {}
    slots = []
    for si, stack_members in by_stack.items():
        stack = plan.stacks[si]
        rows, cols = stack.local_shape
        firsts, batches = [], []
        count = 0
        for i in stack_members:
            e = entries[i]
            firsts.append(count)
            batches.append(None if len(e.local_shape) == 2 else e.local_shape[0])
            count += e.batch
        start = offsets.get(stack.device, 0)
        offsets[stack.device] = start + aligned(count * rows * cols)
        slots.append(StackSlot(si, stack.device, start, count, rows, cols, tuple(stack_members), tuple(firsts),
                               tuple(batches)))
    by_bucket: dict[int, list[int]] = {}
    for i in sorted(members):
        by_bucket.setdefault(entries[i].bucket_index, []).append(i)
    buckets = tuple(
        (bi, tuple(bm), all(_plain(entries[i]) for i in bm)) for bi, bm in sorted(by_bucket.items())
    )
    return ChunkLayout(tuple(members), tuple(slots), tuple(own), offsets, buckets, chunk)


def _plain(entry) -> bool:
    p = entry.param
    return not is_dtensor(p) and tuple(p.shape) == entry.local_shape


def buffer_floats(layouts) -> dict:
    """Per device, the floats of the flat buffer every chunk's stacks fit in (the largest chunk's)."""
    sizes: dict[torch.device, int] = {}
    for layout in layouts:
        for device, floats in layout.floats.items():
            sizes[device] = max(sizes.get(device, 0), floats)
    return sizes


@dataclass
class LayoutCache:
    """The layouts of a plan's chunks per set of entries with a grad; emptied when the chunks change."""

    chunks: tuple = ()
    by_active: dict = field(default_factory=dict)

    # Distinct sets of present grads kept at once: a model normally has one or two (e.g. a frozen
    # part); one that changes every step gains nothing from keeping more.
    MAX_SETS = 8

    def get(self, plan: Plan, active: list[bool]) -> tuple[ChunkLayout, ...]:
        if self.chunks is not plan.chunks:
            self.chunks, self.by_active = plan.chunks, {}
        key = tuple(active)
        hit = self.by_active.get(key)
        if hit is None:
            hit = step_layouts(plan, active)
            if len(self.by_active) >= self.MAX_SETS:
                self.by_active.clear()
            self.by_active[key] = hit
        return hit


def cached_step_layouts(plan: Plan, active: list[bool]) -> tuple[ChunkLayout, ...]:
    """:func:`step_layouts` through the plan's cache (an eager step's: its first call makes it)."""
    if plan.layouts is None:
        plan.layouts = LayoutCache()
    return plan.layouts.get(plan, active)


def step_layouts(plan: Plan, active: list[bool]) -> tuple[ChunkLayout, ...]:
    """The layout of every chunk that has a member with a grad, in step order."""
    out = []
    for k, chunk in enumerate(plan.chunks):
        members = [i for i in chunk if active[i]]
        if members:
            out.append(chunk_layout(plan, members, k))
    return tuple(out)
