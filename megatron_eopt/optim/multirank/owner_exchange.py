"""The owner exchange: one rank (the *owner*) computes each of a set of matrices whose pieces lie on several ranks.

Every matrix gets one owner among the ranks that hold its pieces, balanced by Newton–Schulz FLOPs
(``assign_owners``, ``ns_flops``). Per chunk of matrices, one all-to-all moves the pieces to their
owners, each owner computes its matrices, and one all-to-all returns each rank its part of the
result (``OwnerExchange``). Chunks are pipelined: the collectives are asynchronous, so the pieces
of chunk i+1 travel while chunk i is computed. On CUDA the asynchronous NCCL collectives run on
NCCL's own stream (the side stream), and ``wait()`` only orders the current stream after them, so
the host never blocks; on CPU gloo runs them on its own threads.

The ranks of one exchange are an ``OwnerRoute``: the all-to-alls run over the mesh dim's group when
one mesh dim shards the matrix, and over the world when several do (FSDP x TP, HSDP x TP) and the
mesh spans it: there every replica exchanges among its own ranks in the same collective. On a
smaller mesh (one pipeline stage's) no process group holds those ranks: the pieces hop over the
mesh dims' groups, one all-to-all per dim (``_Transfer``).

The sharded orthogonalizer (``sharded``), the tensor-parallel layer-sharded mode (``tp_modes``) and
the legacy ``DistMuon`` (replicated params, per-rank grads) run their owner steps on this.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ... import _collectives as collectives
from ...step_stats import newton_schulz_flops

# Matrices per rank and chunk in owner mode: two keeps every rank busy while the next chunk's
# shards travel, and same-shape matrices of a chunk still batch into one Newton–Schulz call.
ITEMS_PER_RANK = 2


@dataclass(eq=False)
class OwnerRoute:
    """The ranks that exchange and own a set of matrices in owner mode.

    Owners are *member* indices; ``peers[m]`` is member m's rank in ``group``, the process group
    of the all-to-alls. The group may be larger than the members (the world over a 2-D slice of a
    mesh): the other ranks of the group exchange their own slices' matrices in the same
    collectives, with nothing sent between slices. A relay route has no group: ``hops`` (see
    ``_Transfer``). ``key`` is equal on every rank for routes of the same structure, so every
    rank batches the same matrices into the same collectives.
    """

    group: Any
    peers: tuple[int, ...]
    me: int
    key: tuple
    coordinates: tuple[tuple[int, ...], ...] = ()  # mesh coordinates of the members (DTensor layouts)
    # Relay routes (group None): per hop, a mesh dim's group and each member's rank in it (-1 off
    # this rank's line); each member's coordinates over the hop dims, and the member at each.
    hops: tuple = ()
    grid: tuple[tuple[int, ...], ...] = ()
    member_at: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.peers)


def _coordinates_of(mesh, ranks) -> tuple[tuple[int, ...], ...]:
    """Mesh coordinates of the given global ranks (row-major over the mesh tensor)."""
    where = {int(r): i for i, r in enumerate(mesh.mesh.flatten().tolist())}
    shape = tuple(mesh.mesh.shape)
    out = []
    for r in ranks:
        flat, coordinate = where[int(r)], []
        for size in reversed(shape):
            coordinate.append(flat % size)
            flat //= size
        out.append(tuple(reversed(coordinate)))
    return tuple(out)


def _route_of(mesh, mesh_dims: tuple[int, ...], cache: dict | None) -> OwnerRoute | None:
    """The route over the ranks that share this rank's coordinates on the mesh dims not in
    ``mesh_dims``: that mesh dim's group for one dim; for several (HSDP x TP, FSDP x TP) the
    world when the mesh covers it, else a relay over the groups of ``mesh_dims``.

    ``cache`` lives for one plan build (a module-level cache would keep process groups alive
    past destroy_process_group).
    """
    key = (id(mesh), mesh_dims)
    if cache is not None and key in cache:
        return cache[key]
    route = None
    if len(mesh_dims) == 1:
        group = mesh.get_group(mesh_dims[0])
        ranks = dist.get_process_group_ranks(group)  # global ranks in group-rank order
        route = OwnerRoute(group, tuple(range(len(ranks))), dist.get_rank(group), ("group", id(group)),
                           _coordinates_of(mesh, ranks))
    elif mesh.size() == dist.get_world_size():
        layout = mesh.mesh
        mine = mesh.get_coordinate()
        index = tuple(slice(None) if d in mesh_dims else mine[d] for d in range(mesh.ndim))
        ranks = tuple(int(r) for r in layout[index].flatten().tolist())  # world rank == group rank
        structure = ("world", tuple(layout.shape), tuple(layout.flatten().tolist()), mesh_dims)
        route = OwnerRoute(dist.group.WORLD, ranks, ranks.index(dist.get_rank()), structure,
                           _coordinates_of(mesh, ranks))
    else:
        route = _relay_route(mesh, mesh_dims)
    if cache is not None:
        cache[key] = route
    return route


def _relay_route(mesh, mesh_dims: tuple[int, ...]) -> OwnerRoute:
    """A route over a multi-dim slice of a mesh smaller than the world: no process group holds
    its ranks, so pieces hop over the groups of ``mesh_dims`` one dim at a time (``_Transfer``)."""
    layout = mesh.mesh
    mine = mesh.get_coordinate()
    index = tuple(slice(None) if d in mesh_dims else mine[d] for d in range(mesh.ndim))
    ranks = tuple(int(r) for r in layout[index].flatten().tolist())
    grid = tuple(itertools.product(*(range(mesh.size(d)) for d in mesh_dims)))  # the order of `ranks`
    me = ranks.index(dist.get_rank())
    hops = []
    for h, d in enumerate(mesh_dims):
        group = mesh.get_group(d)
        # Only the members on this rank's line along dim d share its group for this hop.
        on_line = [all(a == b for i, (a, b) in enumerate(zip(c, grid[me])) if i != h) for c in grid]
        line = tuple(dist.get_group_rank(group, r) if ok else -1 for r, ok in zip(ranks, on_line))
        hops.append((group, line))
    structure = ("relay", tuple(layout.shape), tuple(layout.flatten().tolist()), mesh_dims)
    return OwnerRoute(None, ranks, me, structure, _coordinates_of(mesh, ranks), tuple(hops), grid,
                      {c: m for m, c in enumerate(grid)})


def ns_flops(shape) -> float:
    """Newton–Schulz FLOPs of one iteration over a (..., m, n) matrix view (the owners' cost)."""
    *lead, m, n = shape
    return math.prod(lead) * newton_schulz_flops(m, n, 1)  # the one FLOP model (step_stats)


def assign_owners(costs: list[float], size: int, per_chunk: int,
                  load: list[float] | None = None) -> tuple[list[list[int]], list[int]]:
    """Chunks of item indices (consecutive, in the given order) and the owner of each item.

    Within each chunk the costliest item goes first to the least-loaded member (ties to the
    lowest), loads carried over from earlier chunks: every chunk keeps all members busy, and the
    totals end at most one item's cost apart. Deterministic, so every rank computes the same.
    ``load``: each member's load so far (updated in place), to balance over several calls.
    """
    if size < 1 or per_chunk < 1:
        raise ValueError(f"assign_owners: size and per_chunk must be >= 1, got {size} and {per_chunk}")
    chunks = [list(range(i, min(i + per_chunk, len(costs)))) for i in range(0, len(costs), per_chunk)]
    load = [0.0] * size if load is None else load
    owners = [0] * len(costs)
    for chunk in chunks:
        for k in sorted(chunk, key=lambda k: (-costs[k], k)):
            r = min(range(size), key=lambda r: (load[r], r))
            owners[k] = r
            load[r] += costs[k]
    return chunks, owners


class _Transfer:
    """Pieces keyed (source member, destination member, item) in flight over a route.

    ``meta`` lists every piece of the collective as (src, dst, item, numel), the same on every
    rank; ``mine`` holds the flat pieces this rank sends. Over one group this is one asynchronous
    all-to-all. A relay route (no process group holds the members) moves the pieces one mesh dim
    at a time: after hop h a piece sits on the member with the destination's coordinates on the
    first h dims and the source's on the rest, so every hop stays within one mesh dim's group.
    The first hop is asynchronous; ``wait()`` runs the others and returns the pieces addressed to
    this rank.
    """

    def __init__(self, route: OwnerRoute, meta, mine: dict, like: torch.Tensor, first=None) -> None:
        self.route, self.meta, self.like = route, meta, like
        self.sent = 0
        self.held = mine
        self.hop = 0
        # the step's first exchange (multirank.riding.FirstExchange: recorded or carrying headers), or None
        self.first = first
        self.pending = self._start_hop()

    def _position(self, piece, hop: int) -> int:
        # The member a piece sits on after `hop` hops (the direct route has one hop).
        route = self.route
        if not route.hops:
            return piece[0] if hop == 0 else piece[1]
        src, dst = route.grid[piece[0]], route.grid[piece[1]]
        return route.member_at[dst[:hop] + src[hop:]]

    def _group_rank(self, member: int) -> int:
        route = self.route
        if not route.hops:
            return route.peers[member]
        return route.hops[self.hop][1][member]

    def _start_hop(self):
        route, me, hop = self.route, self.route.me, self.hop
        group = route.group if not route.hops else route.hops[hop][0]
        size = dist.get_world_size(group)
        here = [m for m in self.meta if self._position(m, hop) == me]
        there = [m for m in self.meta if self._position(m, hop + 1) == me]
        # all_to_all_single lays both buffers out by rank in the group; within one pair of ranks
        # both sides order the pieces by their key.
        here.sort(key=lambda m: (self._group_rank(self._position(m, hop + 1)), m[:3]))
        there.sort(key=lambda m: (self._group_rank(self._position(m, hop)), m[:3]))
        in_splits, out_splits = [0] * size, [0] * size
        for m in here:
            in_splits[self._group_rank(self._position(m, hop + 1))] += m[3]
        for m in there:
            out_splits[self._group_rank(self._position(m, hop))] += m[3]
        parts = [self.held[m[:3]].reshape(-1) for m in here]
        mine = self._group_rank(me)
        self.sent += (sum(in_splits) - in_splits[mine]) * self.like.element_size()
        first, self.first = self.first, None
        if first is not None:
            dests = [self._group_rank(self._position(m, hop + 1)) for m in here]
            started = first.start(group, self.like.device.type, parts, dests, in_splits, out_splits, self.like)
            if started is not None:  # riding: every source's pieces, then its header
                work, recv, payloads = started
                return work, recv, there, [self._group_rank(self._position(m, hop)) for m in there], payloads
        buf = torch.cat(parts) if parts else self.like.new_empty(0)
        recv = buf.new_empty(sum(out_splits))
        work = collectives.all_to_all_single(recv, buf, out_splits, in_splits, group=group, async_op=True)
        return work, recv, there, None, None

    def _finish_hop(self) -> None:
        work, recv, there, sources, payloads = self.pending
        self.pending = None
        work.wait()
        sizes = [m[3] for m in there]
        if payloads is None:
            pieces = recv.split(sizes)
        else:  # (`there` is in source order: each source's payload splits into its pieces)
            pieces, by_source = [], payloads()
            for source, items in itertools.groupby(zip(sources, sizes), key=lambda x: x[0]):
                pieces += by_source[source].split([n for _, n in items])
        self.held = {m[:3]: t for m, t in zip(there, pieces)}
        self.hop += 1

    def wait(self) -> dict:
        if self.pending is not None:
            self._finish_hop()
        while self.hop < len(self.route.hops):
            self.pending = self._start_hop()
            self._finish_hop()
        return self.held


@dataclass
class OwnerExchange:
    """One pipelined owner exchange over a route (see the module docstring).

    Items are indices into the caller's lists; for item k and member s:

    - ``to_owner(k, s)``: elements member s sends to k's owner; ``send(k)`` gives this rank's (flat);
    - ``compute(owned, pieces)``: the owner's work on its items of a chunk, ``pieces[j][s]`` the
      flat piece member s sent for ``owned[j]``; returns one result per owned item;
    - ``from_owner(k, s)``: elements k's owner sends back to member s; ``back(k, result, s)`` gives it;
    - ``deliver(k, piece)``: this rank's piece of item k's result, after every chunk is computed.

    Every rank must be able to compute ``to_owner`` and ``from_owner`` for any member (a relay
    route forwards other members' pieces). All pieces have ``like``'s dtype and device.
    """

    route: OwnerRoute
    chunks: list[list[int]]
    owners: list[int]
    to_owner: Any
    send: Any
    compute: Any
    from_owner: Any
    back: Any
    deliver: Any
    like: torch.Tensor
    # The step's first owner exchange (multirank.riding.FirstExchange): every transfer's all-to-all
    # goes through it (recorded, or the first with this rank's header); where it carries headers
    # they are read when the exchange is over.
    first: Any = None

    def run(self) -> int:
        """Runs every chunk; returns the bytes this rank sent to other ranks."""
        members, me = range(self.route.size), self.route.me

        def forward(chunk):
            meta = [(s, self.owners[k], k, self.to_owner(k, s)) for k in chunk for s in members]
            # a member that sends an owner nothing (another replica's, replica_work="split") sends it an empty piece
            mine = {(me, self.owners[k], k): self.send(k) if self.to_owner(k, me) else self.like.new_empty(0)
                    for k in chunk}
            return _Transfer(self.route, meta, mine, self.like, self.first)

        transfers, pending_back = [], []
        nxt = forward(self.chunks[0]) if self.chunks else None
        for ci, chunk in enumerate(self.chunks):
            transfer = nxt
            # The next chunk's pieces travel while this chunk is computed.
            nxt = forward(self.chunks[ci + 1]) if ci + 1 < len(self.chunks) else None
            got = transfer.wait()
            transfers.append(transfer)
            owned = [k for k in chunk if self.owners[k] == me]
            results = self.compute(owned, [[got[(s, me, k)] for s in members] for k in owned])
            meta = [(self.owners[k], s, k, self.from_owner(k, s)) for k in chunk for s in members]
            mine = {(me, s, k): self.back(k, result, s) for k, result in zip(owned, results) for s in members}
            pending_back.append((chunk, _Transfer(self.route, meta, mine, self.like, self.first)))
        for chunk, transfer in pending_back:
            got = transfer.wait()
            transfers.append(transfer)
            for k in chunk:
                self.deliver(k, got[(self.owners[k], me, k)])
        if self.first is not None:
            self.first.settle()  # (riding: every rank read every header; raises alike where one differs)
        return sum(t.sent for t in transfers)
