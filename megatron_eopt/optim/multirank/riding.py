"""The ranks' per-step agreement riding on the step's first exchange: ``rank_checks="riding"``.

The default agreement (``multirank.agreement``) is one all-reduce of five integers before a step.
Riding puts the same comparison into the step's first owner exchange instead: every rank appends a
header of 64 bytes (refused, changed, the digest of its agreement fields) to what its first
all-to-all sends each rank, and reads every rank's header when that exchange is over, before the
step writes a parameter or starts any other collective. An exchange's shape depends on the very
things compared (options, the plan, which grads are present), so a rank that differs could not
enter the same exchange: every step rides in the shape of the last step all ranks agreed on, its
*ticket* (the exchange's all-to-alls, in order). A rank whose structure changed since (its
``ride_key`` differs), that refused the step, or whose plan must be rebuilt enters them with zeros
and says so; then every rank puts back what the step wrote before (the first chunk's optimizer
state and the low-memory seeds), and all fall back, together, to the all-reduce over the ticket's
group (which raises the same error on every rank where they differ) and an ordinary step, which
makes the next ticket.

Rides only where the step's first collectives are that exchange over one process group holding
every rank the step communicates with: a plain one-dim FSDP2 step in owner mode (no tensor
parallelism, gather mode, relays, MuonBP, overlap with backward), eager. Elsewhere ``"riding"``
agrees as ``"every_step"`` does. A ticket is made only at the end of a step every rank agreed on,
and never dropped by one rank alone, so every rank enters the same collectives at every step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ... import _collectives as collectives
from ...step_stats import count_agreement
from .agreement import GroupScope, digest_value, fields_bytes
from .dtensor_layout import local

# refused, changed, digest and zeros: int64 each, after this rank's pieces to every rank; 64 bytes, so
# that the pieces after it keep their alignment (unaligned, the exchange was measured slower)
HEADER_WORDS = 8
_HEADER_BYTES = HEADER_WORDS * 8


class RideFallback(Exception):
    """A rank's header says it differs, refused or changed: every rank falls back alike."""


def ride_key(fields) -> int:
    """What decides the step's first exchange: the agreement fields but the param groups' values
    (a scheduled learning rate changes every step and none of them shapes an exchange). Compared
    with the ticket's on this rank only: another key means this rank cannot ride the ticket."""
    return digest_value(fields_bytes([f for f in fields if not _GROUP_VALUE.match(f[0])]))


_GROUP_VALUE = re.compile(r"param_groups\[\d+\]\['(?!params'\])")


def header(refused: bool, changed: bool, digest: int, like: torch.Tensor) -> torch.Tensor:
    """This rank's header as elements of ``like``'s dtype (the exchange's), on its device. Written
    there word by word: a tensor made on the host would be copied to a GPU synchronously, waiting for
    the device's queued work before the exchange starts."""
    words = torch.zeros(HEADER_WORDS, dtype=torch.int64, device=like.device)
    words[0], words[1], words[2] = int(refused), int(changed), digest
    return words.view(torch.uint8).view(like.dtype)


def header_elements(dtype: torch.dtype) -> int:
    """The header's length in elements of ``dtype`` (any dtype's size divides its 64 bytes)."""
    return _HEADER_BYTES // torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Ticket:
    """The all-to-alls of the first owner exchange of the last step every rank agreed on, as this
    rank started them, in order: each one's elements to and from every rank of ``group`` (headers
    excluded), their dtype and device, and that step's ``ride_key``."""

    group: Any
    device_type: str
    splits: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # per all-to-all: (in splits, out splits)
    dtype: torch.dtype
    device: torch.device
    key: int

    @property
    def scope(self) -> GroupScope:
        """The group as the fallback agreement reduces over it."""
        return GroupScope(self.group, self.device_type)

    def matches(self, index: int, group, in_splits, out_splits, like: torch.Tensor) -> bool:
        return (index < len(self.splits) and group is self.group and like.dtype == self.dtype
                and like.device == self.device and self.splits[index] == (tuple(in_splits), tuple(out_splits)))

    def send_changed(self, refused: bool, digest: int) -> None:
        """Enters the ticket's all-to-alls, in order, with zeros, the first with a header saying this
        rank changed (the others fall back with it after the last)."""
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        for index in range(len(self.splits)):
            in_splits, out_splits = self.splits[index]
            if index == 0:
                h = header(refused, True, digest, like)
                parts = [p for n in in_splits for p in (like.new_zeros(n), h)]
                _exchange(self.group, parts, in_splits, out_splits, like).wait()
            else:
                collectives.all_to_all_single(like.new_empty(sum(out_splits)), like.new_zeros(sum(in_splits)),
                                              list(out_splits), list(in_splits), group=self.group)


@dataclass
class _Started:
    """An exchange under way with headers (``work``; ``recv`` holds every source's pieces then header)."""

    work: Any
    recv: torch.Tensor
    out_splits: tuple[int, ...]
    words: int

    def wait(self) -> None:
        self.work.wait()

    def payloads(self) -> list[torch.Tensor]:
        """Per source rank, the elements it sent (header stripped), views of ``recv``."""
        segments = self.recv.split([n + self.words for n in self.out_splits])
        return [s[:n] for s, n in zip(segments, self.out_splits)]

    def headers(self) -> list[tuple[int, int, int]]:
        segments = self.recv.split([n + self.words for n in self.out_splits])
        words = torch.cat([s[n:] for s, n in zip(segments, self.out_splits)]).cpu()
        return [tuple(row[:3]) for row in words.view(torch.uint8).view(torch.int64).view(-1, HEADER_WORDS).tolist()]


def _exchange(group, parts, in_splits, out_splits, like: torch.Tensor) -> _Started:
    """One asynchronous all-to-all of ``parts`` (already in rank order, headers included) whose
    payloads are ``in_splits``/``out_splits`` elements, a header more to and from every rank."""
    words = header_elements(like.dtype)
    buf = torch.cat(parts) if parts else like.new_empty(0)
    recv = like.new_empty(sum(out_splits) + words * len(out_splits))
    work = collectives.all_to_all_single(recv, buf, [n + words for n in out_splits], [n + words for n in in_splits],
                                         group=group, async_op=True)
    size = len(in_splits)
    count_agreement((size - 1) * _HEADER_BYTES)
    return _Started(work, recv, tuple(out_splits), words)


class FirstExchange:
    """The all-to-alls of the step's first owner exchange, as it starts them (``owner_exchange``
    hands it the first hop of each transfer): recorded, where the step makes the next ticket, or
    riding a ticket, the first with this rank's header, where the step rides. The headers are
    read once the exchange is over (``settle``), before the step writes a parameter or starts any
    other collective; the exchange itself keeps its pipeline."""

    def __init__(self, ticket: Ticket | None = None, digest: int = 0, saved: "FirstChunkState | None" = None) -> None:
        self.ticket = ticket
        self.digest = digest
        self.saved = saved  # riding: what the step wrote before the exchange, until the headers agree
        self.group = self.device_type = self.like = None  # recorded: the exchange's group and elements
        self.splits: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self._started: _Started | None = None

    def start(self, group, device_type: str, parts, dests, in_splits, out_splits, like: torch.Tensor):
        """Starts the next all-to-all of ``parts`` (flat pieces in rank order, ``dests[j]``: part j's
        destination rank in ``group``). Returns ``(work, recv, payloads)`` for the all-to-all carrying the
        header (``payloads`` gives each source's pieces), None where the caller makes it as usual."""
        index = len(self.splits)
        self.splits.append((tuple(in_splits), tuple(out_splits)))
        ticket = self.ticket
        if ticket is None:  # recording
            self.group, self.device_type, self.like = group, device_type, like
        elif not ticket.matches(index, group, in_splits, out_splits, like):
            if index == 0:
                # (the ride key covers what shapes the exchange; a shape it missed still meets the others')
                ticket.send_changed(False, self.digest)
                raise RideFallback("the step's first exchange differs from its ticket")
            # Past the header every rank decides by the key alone, equal here: the exchange is a function
            # of what it covers (plan, grads present, options), so this is not reached.
            raise RuntimeError("rank_checks='riding': the step's exchange departs from its ticket after its first "
                               "all-to-all, with the same plan and grads; use rank_checks='every_step'")
        elif index == 0:
            h = header(False, False, self.digest, like)
            with_headers, j = [], 0
            for rank in range(len(in_splits)):  # (parts are in rank order: each rank's, then the header)
                while j < len(parts) and dests[j] == rank:
                    with_headers.append(parts[j])
                    j += 1
                with_headers.append(h)
            self._started = started = _exchange(group, with_headers, in_splits, out_splits, like)
            return started.work, started.recv, started.payloads
        return None

    def settle(self) -> None:
        """After the exchange: raises :class:`RideFallback` (on every rank alike: each read every
        rank's header) where any rank refused, changed or holds other fields."""
        if self._started is None:
            return
        if len(self.splits) != len(self.ticket.splits):
            raise RuntimeError("rank_checks='riding': the step's exchange made other all-to-alls than its ticket")
        rows = self._started.headers()
        if any(refused or changed for refused, changed, _ in rows) or len({d for _, _, d in rows}) > 1:
            raise RideFallback("a rank differs")
        if self.saved is not None:
            self.saved.drop()  # (no rank falls back now)

    def make_ticket(self, key: int) -> Ticket | None:
        if self.ticket is not None:
            return self.ticket
        if self.like is None:
            return None
        return Ticket(self.group, self.device_type, tuple(self.splits), self.like.dtype, self.like.device, key)


def rides(plan, layouts) -> bool:
    """Whether the step's first collective is one owner all-to-all over one process group holding
    every rank the step communicates with: its matrices spanning ranks all in owner mode over the
    same direct route of a mesh with one dim of more than one rank, no tensor-parallel, GTP or
    layer-home stack (``_ride_group``, kept with the plan), and one in the step's first chunk."""
    group = getattr(plan, "_ride_group", _UNSET)
    if group is _UNSET:
        group = plan._ride_group = _ride_group(plan)
    return group is not None and bool(layouts) and any(plan.entries[i].spans_ranks for i in layouts[0].members)


_UNSET = object()


def _ride_group(plan):
    """The one group a step of ``plan`` could ride (None: none; see :func:`rides`)."""
    if any(s.tp is not None or s.gtp is not None or s.home is not None for s in plan.stacks):
        return None
    group = None
    for e in plan.entries:
        if not e.spans_ranks:
            continue
        s = e.sharding
        if s is None or s.kind != "owner" or s.route is None or s.route.hops or s.route.group is None:
            return None
        if sum(1 for d in range(s.mesh.ndim) if s.mesh.size(d) > 1) != 1:
            return None
        if group is not None and s.route.group is not group:
            return None
        group = s.route.group
    return group


class FirstChunkState:
    """The optimizer state of the first chunk's entries as it was before the step: what a ride that
    falls back puts back (its momentum phase ran before the exchange). One flat copy per dtype and
    device (a copy per tensor would allocate, and on the host fault in, each one apart). ``kept``:
    host buffers kept between steps, reused where large enough (a fresh host buffer faults its pages
    in at every step; on a GPU the caching allocator reuses its blocks, and a buffer kept past the
    step would add to the training's peak)."""

    def __init__(self, opt, plan, members, kept: dict | None = None) -> None:
        self.opt = opt
        self.entries = []  # (param, {key: value} of its state's non-tensors, [tensor keys]) or (param, None)
        tensors: dict[tuple, list[torch.Tensor]] = {}
        for i in members:
            p = plan.entries[i].param
            state = opt.state.get(p)
            if state is None:
                self.entries.append((p, None, []))
                continue
            keys = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
            self.entries.append((p, {k: v for k, v in state.items() if k not in keys}, keys))
            for k in keys:
                t = local(state[k])
                tensors.setdefault((t.dtype, t.device), []).append(t)
        self.copies = []  # (the state's tensors, views of their flat copy)
        for (dtype, device), sources in tensors.items():
            n = sum(t.numel() for t in sources)
            flat = None if kept is None or device.type != "cpu" else kept.get((dtype, device))
            if flat is None or flat.numel() < n:
                flat = torch.empty(n, dtype=dtype, device=device)
                if kept is not None and device.type == "cpu":
                    kept[(dtype, device)] = flat
            flat = flat[:n]
            views = [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in sources]), sources)]
            torch._foreach_copy_(views, sources)
            self.copies.append((sources, views))

    def drop(self) -> None:
        self.entries, self.copies = [], []

    def restore(self) -> None:
        for p, others, keys in self.entries:
            if others is None:
                self.opt.state.pop(p, None)
                continue
            state = self.opt.state[p]
            for k in [k for k in state if k not in others and k not in keys]:
                del state[k]
            state.update(others)
        for sources, views in self.copies:  # (the state's own tensors, written in place)
            torch._foreach_copy_(sources, views)
