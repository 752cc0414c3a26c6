"""The ranks' per-step agreement riding on the step's first exchange: ``rank_checks="riding"``.

The default agreement (``multirank.agreement``) is one all-reduce of five integers before a step.
Riding puts the same comparison into the step's first owner all-to-all instead: every rank appends
a header of three int64 (refused, changed, the digest of its agreement fields) to what it sends
each rank, and reads every rank's header before any other collective starts. An exchange's shape
depends on the very things compared (options, the plan, which grads are present), so a rank that
differs could not enter the same exchange: every step rides in the shape of the last step all ranks
agreed on, its *ticket*. A rank whose structure changed since (its ``ride_key`` differs), that
refused the step, or whose plan must be rebuilt sends zeros in the ticket's shape and says so; then
every rank puts back what the step wrote before the exchange (the first chunk's optimizer state and
the low-memory seeds), and all fall back, together, to the all-reduce over the ticket's group (which
raises the same error on every rank where they differ) and an ordinary step, which makes the next
ticket.

Rides only where the step's first collective is that exchange over one process group holding every
rank the step communicates with: a plain one-dim FSDP2 step in owner mode (no tensor parallelism,
gather mode, relays, MuonBP, overlap with backward), eager. Elsewhere ``"riding"`` agrees as
``"every_step"`` does. A ticket is made only at the end of a step every rank agreed on, and never
dropped by one rank alone, so every rank enters the same collective at every step.
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

HEADER_WORDS = 3  # refused, changed, digest: int64 each, after this rank's pieces to every rank
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
    """This rank's header as elements of ``like``'s dtype (the exchange's), on its device."""
    words = torch.tensor([int(refused), int(changed), digest], dtype=torch.int64)
    return words.view(torch.uint8).view(like.dtype).to(like.device)


def header_elements(dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    if _HEADER_BYTES % size:
        raise ValueError(f"rank_checks='riding' cannot append an int64 header to an exchange of {dtype}")
    return _HEADER_BYTES // size


@dataclass(frozen=True)
class Ticket:
    """The first all-to-all of the last step every rank agreed on, as this rank made it: its group,
    the elements it sent each rank and received from each (headers excluded), their dtype and device,
    and the ``ride_key`` of that step."""

    group: Any
    device_type: str
    in_splits: tuple[int, ...]
    out_splits: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    key: int

    @property
    def scope(self) -> GroupScope:
        """The group as the fallback agreement reduces over it."""
        return GroupScope(self.group, self.device_type)

    def matches(self, group, in_splits, out_splits, like: torch.Tensor) -> bool:
        return (group is self.group and tuple(in_splits) == self.in_splits and tuple(out_splits) == self.out_splits
                and like.dtype == self.dtype and like.device == self.device)

    def send_changed(self, refused: bool, digest: int) -> None:
        """Enters the ticket's exchange with zeros and a header saying this rank changed (the others
        then fall back with it)."""
        like = torch.empty(0, dtype=self.dtype, device=self.device)
        h = header(refused, True, digest, like)
        parts = [p for n in self.in_splits for p in (torch.zeros(n, dtype=self.dtype, device=self.device), h)]
        _exchange(self.group, parts, self.in_splits, self.out_splits, like).wait()


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
        return [tuple(row) for row in words.view(torch.uint8).view(torch.int64).view(-1, HEADER_WORDS).tolist()]


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
    """The step's first all-to-all, as the owner exchange makes it (``owner_exchange._Transfer``
    hands it its first hop): recorded, where the step makes the next ticket, or riding a ticket
    with this rank's header, where the step rides."""

    def __init__(self, ticket: Ticket | None = None, digest: int = 0, saved: "FirstChunkState | None" = None) -> None:
        self.ticket = ticket
        self.digest = digest
        self.saved = saved  # riding: what the step wrote before the exchange, until the headers agree
        self.shape: tuple | None = None  # recorded: (group, device type, in, out splits, dtype, device)
        self._started: _Started | None = None

    def start(self, group, device_type: str, parts, dests, in_splits, out_splits, like: torch.Tensor):
        """Starts the exchange of ``parts`` (flat pieces in rank order, ``dests[j]``: part j's
        destination rank in ``group``). Returns ``(work, recv, payloads)``: ``payloads`` None where
        ``recv`` holds the pieces alone, else a function giving each source's pieces (riding)."""
        if self.ticket is None:  # recording: the exchange as it is
            self.shape = (group, device_type, tuple(in_splits), tuple(out_splits), like.dtype, like.device)
            buf = torch.cat(parts) if parts else like.new_empty(0)
            recv = buf.new_empty(sum(out_splits))
            work = collectives.all_to_all_single(recv, buf, list(out_splits), list(in_splits), group=group,
                                                 async_op=True)
            return work, recv, None
        ticket = self.ticket
        if not ticket.matches(group, in_splits, out_splits, like):
            # (the ride key covers what shapes this exchange; a shape it missed still meets the others' exchange)
            ticket.send_changed(False, self.digest)
            raise RideFallback("the step's first exchange differs from its ticket")
        h = header(False, False, self.digest, like)
        with_headers, j = [], 0
        for rank in range(len(in_splits)):  # (parts are in rank order: each rank's, then the header)
            while j < len(parts) and dests[j] == rank:
                with_headers.append(parts[j])
                j += 1
            with_headers.append(h)
        self._started = started = _exchange(group, with_headers, in_splits, out_splits, like)
        return started.work, started.recv, started.payloads

    def settle(self) -> None:
        """After the exchange: raises :class:`RideFallback` (on every rank alike: each read every
        rank's header) where any rank refused, changed or holds other fields."""
        if self._started is None:
            return
        rows = self._started.headers()
        if any(refused or changed for refused, changed, _ in rows) or len({d for _, _, d in rows}) > 1:
            raise RideFallback("a rank differs")
        if self.saved is not None:
            self.saved.drop()  # (no rank falls back now: the copy goes before the chunk's Newton–Schulz)

    @property
    def riding(self) -> bool:
        return self.ticket is not None

    def make_ticket(self, key: int) -> Ticket | None:
        if self.ticket is not None:
            return self.ticket
        if self.shape is None:
            return None
        group, device_type, in_splits, out_splits, dtype, device = self.shape
        return Ticket(group, device_type, in_splits, out_splits, dtype, device, key)


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
    falls back puts back (its momentum phase ran before the exchange)."""

    def __init__(self, opt, plan, members) -> None:
        self.opt = opt
        self.saved = []
        for i in members:
            p = plan.entries[i].param
            state = opt.state.get(p)
            self.saved.append((p, None if state is None else
                               {k: local(v).clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}))

    def drop(self) -> None:
        self.saved = []

    def restore(self) -> None:
        for p, saved in self.saved:
            if saved is None:
                self.opt.state.pop(p, None)
                continue
            state = self.opt.state[p]
            for k in [k for k in state if k not in saved]:
                del state[k]
            for k, v in saved.items():
                if isinstance(v, torch.Tensor) and isinstance(state.get(k), torch.Tensor):
                    local(state[k]).copy_(v)
                else:
                    state[k] = v
