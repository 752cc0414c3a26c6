"""DTensor (FSDP2, tensor parallel, HSDP) parameters: layouts, and orthogonalization of sharded matrices.

The elementwise part of a step (momentum, decay, update, AdaMuon) runs on ``to_local()`` views
through the fused ops; only Newton–Schulz and the NorMuon / NAMO statistics need the whole
matrix. This module describes where each rank's shard sits in the full matrix (a *box*: offset
and shape per dim, from the placements with DTensor's chunking rule, checked against the real
local tensor) and orthogonalizes the sharded matrices in one of two modes:

- ``owner`` (default): every full matrix gets one owner rank among the ranks that shard it,
  balanced by Newton–Schulz FLOPs. Per chunk of matrices, one all-to-all moves the shards to
  their owners, each owner runs one batched Newton–Schulz per shape, and one all-to-all returns
  each rank its part of the result. Chunks are pipelined: the collectives are asynchronous, so
  the shards of chunk i+1 travel while chunk i is orthogonalized. On CUDA the asynchronous NCCL
  collectives run on NCCL's own stream (the side stream), and ``wait()`` only orders the current
  stream after them, so the host never blocks; on CPU gloo runs them on its own threads. The
  all-to-alls run over the mesh dim's group when one mesh dim shards the matrix, and over the
  world when several do (FSDP x TP, HSDP x TP) and the mesh spans it: there every replica
  exchanges among its own ranks in the same collective. On a smaller mesh (one pipeline stage's)
  no process group holds those ranks: the pieces hop over the mesh dims' groups, one all-to-all
  per dim (see ``OwnerRoute`` and ``_Transfer``).
- ``gather``: the reference. Each matrix is all-gathered by DTensor (``full_tensor``), every
  rank orthogonalizes it and keeps its part. Also the fallback for placements without a
  rectangular box per rank (e.g. FSDP2's strided shards over tensor parallelism).

``assign_owners`` and ``OwnerExchange`` are the owner machinery on their own; the legacy
``DistMuon`` (replicated params, per-rank grads) runs its data-parallel step on them.

Matrices whose matrix dims are not sharded (Replicate, or MoE experts sharded on dim 0 in
``nd_mode="batch"``) need no communication: they join the ordinary batched stacks.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ... import _collectives as collectives
from ..matrix_view import matrix_view, split_newton_schulz

try:  # torch.distributed.tensor is public from torch 2.4; guarded for builds without distributed
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    try:
        from torch.distributed.tensor import Partial
    except ImportError:  # pragma: no cover
        from torch.distributed.tensor.placement_types import Partial
except ImportError:  # pragma: no cover
    DTensor = Replicate = Shard = Partial = distribute_tensor = None

SHARDED_MODES = ("owner", "gather")
# What the replicas of a matrix (mesh dims that replicate it: HSDP's replicate dim) do in owner mode:
# "repeat" orthogonalizes every matrix once per replica; "split" once in the whole mesh, its owner
# chosen among the ranks of every replica and its result sent to the ranks of all of them; "auto"
# picks one of them by the cost model (multirank.replica_work) when the plan is built.
REPLICA_WORK = ("auto", "repeat", "split")
# Matrices per rank and chunk in owner mode: two keeps every rank busy while the next chunk's
# shards travel, and same-shape matrices of a chunk still batch into one Newton–Schulz call.
ITEMS_PER_RANK = 2


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (a view sharing its storage), or t itself."""
    return t.to_local() if is_dtensor(t) else t


@dataclass(eq=False)
class ShardLayout:
    """Where a DTensor parameter lives; coordinates are those of its matrix view (see nd_mode)."""

    mesh: Any
    placements: tuple
    view_shape: tuple[int, ...]  # global shape of the matrix view: (m, n) or (E, m, n)
    kind: str  # "local" (no communication) | "owner" | "gather"
    # tensor dim of the view -> mesh dims that shard it (statistics over that dim are all-reduced there)
    shard_dims: dict[int, tuple[int, ...]] = field(default_factory=dict)
    route: OwnerRoute | None = None  # owner mode: the ranks that hold the parts of one matrix
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # per route member
    # (offset, size) of this rank's shard in view coordinates; None where the placements are not
    # plain Shard / Replicate (FSDP2's strided shards over tensor parallelism), whose local rows
    # are not one contiguous range of the matrix
    local_box: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    # The largest local view any rank holds (the first shard along every sharded dim, by DTensor's
    # chunking rule): derived from the global shape and the mesh only, so a plan sized by it (the
    # workspace chunks) is the same on every rank, whatever this rank's own shard is.
    largest_view: tuple[int, ...] = ()
    # Megatron-FSDP's shards off DTensor's chunking rule: (mesh dim, sizes per coordinate), else None
    uneven: tuple[int, tuple[int, ...]] | None = None
    # Owner mode: the part of the view the route's members hold between them, (offset, shape): the
    # whole view, or an expert batch's slice where a mesh dim outside the route shards the experts
    # (EP), which is all an owner assembles and orthogonalizes.
    region: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    # replica_work="split": each route member's replica (its coordinates on the replicating mesh
    # dims); an owner assembles a matrix from the members of its own replica only. Empty: the route
    # holds one replica.
    replicas: tuple[tuple[int, ...], ...] = ()

    def sends_to_owner(self, member: int, owner: int) -> bool:
        """Whether route member ``member`` sends its shard to ``owner`` (both of one replica)."""
        return not self.replicas or self.replicas[member] == self.replicas[owner]

    @property
    def mesh_dims_for_matrix(self) -> tuple[int, ...]:
        """Mesh dims that shard the matrix dims (the last two of the view)."""
        nd = len(self.view_shape)
        return tuple(sorted({i for d in (nd - 2, nd - 1) for i in self.shard_dims.get(d, ())}))


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of part `index` of `size` split as torch.chunk / DTensor's Shard do."""
    full = -(-size // parts) if size else 0
    start = min(index * full, size)
    return start, max(0, min(full, size - start))


def _is_shard(pl) -> bool:
    # Shard, and FSDP2's _StridedShard over tensor parallelism (not a Shard subclass in every
    # torch version); both split a tensor dim `pl.dim` over a mesh dim.
    return isinstance(pl, Shard) or (type(pl).__name__ == "_StridedShard" and hasattr(pl, "dim"))


def _box(shape, placements, coordinate, mesh_shape, uneven=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (offset, size) of the shard at mesh ``coordinate``; ``uneven`` (mesh dim, sizes): the one
    sharding mesh dim's shards as the ranks hold them, in coordinate order (Megatron-FSDP's)."""
    offset, length = [0] * len(shape), list(shape)
    for i, pl in enumerate(placements):
        if type(pl) is Shard:
            d = pl.dim
            if uneven is not None and uneven[0] == i:
                sizes = uneven[1]
                start, n = sum(sizes[: coordinate[i]]), sizes[coordinate[i]]
            else:
                start, n = _chunk(length[d], mesh_shape[i], coordinate[i])
            offset[d] += start
            length[d] = n
    return tuple(offset), tuple(length)


def uneven_splits(params) -> list[tuple[int, tuple[int, ...]] | None]:
    """Per param: for a DTensor sharded over one mesh dim (the others replicating it) whose shards
    do not follow DTensor's chunking rule (Megatron-FSDP cuts its flat buffers where it likes),
    ``(mesh dim, size of the sharded dim on each rank of that mesh dim)``; else None. The sizes are
    gathered from the ranks, one ``all_gather_object`` per mesh dim of each mesh (every rank holds
    the same params, so every rank makes the same calls); a plan build calls it on every rank."""
    out: list[tuple[int, tuple[int, ...]] | None] = [None] * len(params)
    if not dist.is_available() or not dist.is_initialized():
        return out
    asks: dict[tuple[int, int], tuple[Any, list]] = {}  # (id(mesh), mesh dim) -> (mesh, [(index, param, dim)])
    for index, p in enumerate(params):
        if not is_dtensor(p):
            continue
        sharding = [(i, pl) for i, pl in enumerate(p.placements) if _is_shard(pl) and p.device_mesh.size(i) > 1]
        if len(sharding) != 1 or type(sharding[0][1]) is not Shard:
            continue
        i, pl = sharding[0]
        asks.setdefault((id(p.device_mesh), i), (p.device_mesh, []))[1].append((index, p, pl.dim % p.ndim))
    for (_, i), (mesh, members) in asks.items():
        group = mesh.get_group(i)
        gathered: list = [None] * dist.get_world_size(group)
        collectives.all_gather_object(gathered, [int(p.to_local().shape[d]) for _, p, d in members], group=group)
        for k, (index, p, d) in enumerate(members):
            sizes = tuple(int(g[k]) for g in gathered)
            rule = tuple(_chunk(p.shape[d], len(sizes), c)[1] for c in range(len(sizes)))
            if sizes != rule and sum(sizes) == p.shape[d]:
                out[index] = (i, sizes)
    return out


def _view_box(shape, view, placements, coordinate, mesh_shape, uneven=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The box of a shard in the coordinates of the matrix view ``view`` of a param of ``shape``:
    the param's own box (DTensor chunks the param's dims, not the view's), mapped to the view. Views
    that merge dims ("flatten", or "batch" over more than three dims) are sharded on dim 0 only
    (describe refuses the rest), so a merged dim's box is dim 0's times the merged inner sizes."""
    offset, size = _box(shape, placements, coordinate, mesh_shape, uneven)
    if len(view) == len(shape):
        return offset, size
    inner = math.prod(shape[1:]) // math.prod(view[1:]) if math.prod(view[1:]) else 1
    tail = len(view) - 1
    return ((offset[0] * inner,) + (0,) * tail, (size[0] * inner,) + tuple(view[1:]))


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


def describe(
    p: torch.Tensor, nd_mode: str, sharded_mode: str, where: str, cache: dict | None = None,
    replica_work: str = "repeat", uneven: tuple[int, tuple[int, ...]] | None = None, check_local: bool = True,
) -> ShardLayout:
    """The layout of DTensor parameter p; ValueError naming `where` when it cannot be optimized
    (``replica_work="split"`` included, for a matrix whose replicas cannot share its owner).
    ``uneven``: its shards off DTensor's chunking rule (:func:`uneven_splits`); ``check_local=False``
    leaves the local shard unchecked (before the ranks' shards are known)."""
    mesh, placements = p.device_mesh, tuple(p.placements)
    shape = tuple(p.shape)
    nd = len(shape)
    shard_dims: dict[int, list[int]] = {}
    exact = True
    for i, pl in enumerate(placements):
        if isinstance(pl, Partial):
            raise ValueError(
                f"{where} has a Partial placement on mesh dim {i} ({pl}): a pending reduction cannot be optimized; "
                "redistribute it to Shard or Replicate first"
            )
        if _is_shard(pl):
            exact = exact and type(pl) is Shard and pl.dim >= 0
            if mesh.size(i) > 1:  # sharded over one rank: the whole dim is local, as if replicated
                shard_dims.setdefault(pl.dim % nd, []).append(i)
        elif not isinstance(pl, Replicate):
            raise ValueError(f"{where} has an unsupported placement {pl} on mesh dim {i}")
    view = matrix_view(shape, nd_mode)
    if nd > 2 and nd_mode == "flatten":
        if any(d != 0 for d in shard_dims):
            raise ValueError(
                f"{where}: nd_mode='flatten' views the param as (size(0), -1), so it may be sharded on dim 0 only; "
                f"got placements {list(placements)}"
            )
    elif nd > 2:  # batch
        if nd != 3 and any(d != 0 for d in shard_dims):
            raise ValueError(
                f"{where}: nd_mode='batch' on a sharded {nd}-D param needs it 3-D (E, m, n) or sharded on dim 0 only; "
                f"got shape {shape} and placements {list(placements)}"
            )
    layout = ShardLayout(mesh, placements, view, "local", {d: tuple(v) for d, v in shard_dims.items()},
                         largest_view=matrix_view(_largest_shard(shape, placements, mesh, uneven), nd_mode),
                         uneven=uneven)
    if uneven is not None and sharded_mode != "owner":
        raise ValueError(
            f"{where}: its shards are not where DTensor's chunking rule puts them ({list(uneven[1])} rows or columns "
            f"per rank on mesh dim {uneven[0]}, as Megatron-FSDP cuts them): sharded_mode='gather' all-gathers by that "
            "rule; use sharded_mode='owner'"
        )
    coordinate = mesh.get_coordinate()
    if exact and coordinate is not None and check_local:
        layout.local_box = _view_box(shape, view, placements, coordinate, tuple(mesh.mesh.shape), uneven)
        mine = layout.local_box[1]
        if tuple(mine) != matrix_view(tuple(p.to_local().shape), nd_mode):
            # Every rank must take the same path: a shard that is not where DTensor's chunking rule
            # puts it is refused (on every rank alike: the callers agree on refusals, multirank.agreement).
            raise ValueError(
                f"{where}: its local shard has shape {tuple(p.to_local().shape)}, but placements {list(placements)} "
                f"of shape {shape} put a shard of {tuple(mine)} on this rank (DTensor's chunking rule, as "
                "torch.chunk splits); redistribute it to a layout that follows that rule, e.g. with "
                "distribute_tensor or FSDP2's fully_shard"
            )
    matrix_dims = layout.mesh_dims_for_matrix
    if not matrix_dims:
        return layout  # replicated, or experts sharded on the batch dim: each rank holds whole matrices
    replica_dims: tuple[int, ...] = ()
    if replica_work == "split":
        replica_dims = tuple(i for i, pl in enumerate(placements)
                             if isinstance(pl, Replicate) and mesh.size(i) > 1)
        if replica_dims and not exact:
            raise ValueError(
                f"{where}: replica_work='split' needs plain Shard / Replicate placements (one box per rank), got "
                f"{list(placements)}; use replica_work='repeat' for it"
            )
    route = None
    if sharded_mode == "owner" and exact:
        route = _route_of(mesh, tuple(sorted(matrix_dims + replica_dims)), cache)
    if route is None:
        layout.kind = "gather"
        return layout
    layout.kind, layout.route = "owner", route
    mesh_shape = tuple(mesh.mesh.shape)
    for coordinate in route.coordinates:
        layout.boxes.append(_view_box(shape, view, placements, coordinate, mesh_shape, uneven))
    origin = tuple(min(b[0][d] for b in layout.boxes) for d in range(len(view)))
    end = tuple(max(b[0][d] + b[1][d] for b in layout.boxes) for d in range(len(view)))
    layout.region = (origin, tuple(e - o for o, e in zip(origin, end)))
    if replica_dims:
        layout.replicas = tuple(tuple(c[d] for d in replica_dims) for c in route.coordinates)
    return layout


def _largest_shard(shape, placements, mesh, uneven=None) -> tuple[int, ...]:
    """The largest local shape of a tensor of ``shape`` over ``mesh`` (the first shard along every
    sharded dim: DTensor's chunking rule gives it ceil(size / parts), the others no more; with
    ``uneven`` shards, the largest of them)."""
    out = list(shape)
    for i, pl in enumerate(placements):
        if _is_shard(pl):
            d = pl.dim % len(shape)
            if uneven is not None and uneven[0] == i:
                out[d] = max(uneven[1])
            else:
                out[d] = -(-out[d] // mesh.size(i)) if out[d] else 0
    return tuple(out)


def _view_dim(param_ndim: int, view_ndim: int, d: int) -> int:
    """The matrix-view dim that param dim ``d`` lies in (merged dims: see matrix_view)."""
    if param_ndim == view_ndim:
        return d
    if view_ndim == 2:  # flatten: (size(0), rest)
        return 0 if d == 0 else 1
    return 0 if d < param_ndim - 2 else d - (param_ndim - 3)  # batch: (prod(leading), m, n)


def statistic_placements(layout: ShardLayout, param_ndim: int, kept_view_dims) -> list:
    """Placements of a statistic of a sharded param (NorMuon's row or column means, NAMO's norms)
    stored with the param's leading dims (second_moment.moment2_state_shape): a mesh dim that
    shards a view dim the statistic keeps (an expert, or NorMuon's long side) shards the state
    along the same param dim; one that shards a dim the statistic reduces over replicates it (the
    reduction spans the shards, every rank holds the whole statistic). Deciding by the view's dims,
    not by equal sizes: a reduced dim of size one is still reduced."""
    view_ndim = len(layout.view_shape)
    out = []
    for pl in layout.placements:
        if _is_shard(pl):
            d = pl.dim % param_ndim
            out.append(pl if _view_dim(param_ndim, view_ndim, d) in kept_view_dims else Replicate())
        else:
            out.append(pl)
    return out


def zeros_state(p: torch.Tensor, layout: ShardLayout, shape, dtype, kept_view_dims) -> torch.Tensor:
    """A zero state DTensor of `shape` on p's mesh (placements from statistic_placements)."""
    placements = statistic_placements(layout, p.dim(), set(kept_view_dims))
    full = torch.zeros(shape, dtype=dtype, device=p.to_local().device)  # small: reduced statistics only
    return distribute_tensor(full, layout.mesh, placements, src_data_rank=None)


def ns_flops(shape) -> float:
    """Newton–Schulz FLOPs of one iteration over a (..., m, n) matrix view (the owners' cost)."""
    *lead, m, n = shape
    s, l = min(m, n), max(m, n)
    return math.prod(lead) * s * s * (4 * l + 2 * s)


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

    def __init__(self, route: OwnerRoute, meta, mine: dict, like: torch.Tensor) -> None:
        self.route, self.meta, self.like = route, meta, like
        self.sent = 0
        self.held = mine
        self.hop = 0
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
        buf = torch.cat(parts) if parts else self.like.new_empty(0)
        recv = buf.new_empty(sum(out_splits))
        work = collectives.all_to_all_single(recv, buf, out_splits, in_splits, group=group, async_op=True)
        mine = self._group_rank(me)
        self.sent += (buf.numel() - in_splits[mine]) * buf.element_size()
        return work, recv, there

    def _finish_hop(self) -> None:
        work, recv, there = self.pending
        work.wait()
        self.held = {m[:3]: t for m, t in zip(there, recv.split([m[3] for m in there]))}
        self.hop += 1

    def wait(self) -> dict:
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

    def run(self) -> int:
        """Runs every chunk; returns the bytes this rank sent to other ranks."""
        members, me = range(self.route.size), self.route.me

        def forward(chunk):
            meta = [(s, self.owners[k], k, self.to_owner(k, s)) for k in chunk for s in members]
            # a member that sends an owner nothing (another replica's, replica_work="split") sends it an empty piece
            mine = {(me, self.owners[k], k): self.send(k) if self.to_owner(k, me) else self.like.new_empty(0)
                    for k in chunk}
            return _Transfer(self.route, meta, mine, self.like)

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
            pending_back.append((chunk, _Transfer(self.route, meta, mine, self.like)))
        for chunk, transfer in pending_back:
            got = transfer.wait()
            transfers.append(transfer)
            for k in chunk:
                self.deliver(k, got[(self.owners[k], me, k)])
        return sum(t.sent for t in transfers)


def _slices(box):
    offset, shape = box
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


class ShardedOrthogonalizer:
    """Orthogonalizes the sharded matrices of one step (owner or gather mode, see module docstring)."""

    def __init__(self, config) -> None:
        self.config = config
        self.bytes_sent = 0  # owner mode: bytes this rank put into all-to-alls (benchmarks read it)
        # Matrices orthogonalized per mode since construction (tests and benchmarks read it).
        self.matrices = {mode: 0 for mode in SHARDED_MODES}
        # count_below_eps(x, eps): told every whole matrix (a (k, m, n) view) before its Newton–Schulz,
        # on the rank that runs it (the owner; every rank in gather mode). Set by the optimizer.
        self.count_below_eps = None
        # Each route's members' Newton–Schulz FLOPs so far in this step (keyed by route.key; the
        # tensor-parallel layer-sharded homes by their TPLayout.key): a step in several chunks (the
        # workspace budget; a large matrix is a chunk of its own) balances its owners over all of
        # them, not chunk by chunk from zero. Cleared by the optimizer at the start of a step.
        self.loads: dict[tuple, list[float]] = {}

    def _ns(self, full: list[torch.Tensor], config=None, splits=None) -> list[torch.Tensor]:
        """One batched Newton–Schulz per matrix shape over 2-D (m, n) and 3-D (E, m, n) tensors, with
        ``config`` (None: the orthogonalizer's own). ``splits[k]``: the QKVSplit of a fused
        projection, orthogonalized part by part as the unsharded step does (parts scaled for Muon,
        raw for the adaptive variants, which scale them after their normalization)."""
        config = self.config if config is None else config
        out: list[torch.Tensor | None] = [None] * len(full)
        by_shape: dict[tuple[int, int], list[int]] = {}
        if self.count_below_eps is not None:
            for t in full:
                self.count_below_eps(t.reshape(-1, *t.shape[-2:]), config.ns_eps)
        for k, t in enumerate(full):
            split = None if splits is None else splits[k]
            if split is not None:
                res = split_newton_schulz(config, t.reshape(-1, *t.shape[-2:]), split,
                                          scaled=config.moment2_method is None)
                out[k] = res.view(t.shape)
                continue
            by_shape.setdefault(tuple(t.shape[-2:]), []).append(k)
        for ks in by_shape.values():
            batch = torch.cat([full[k].reshape(-1, *full[k].shape[-2:]) for k in ks])
            res = config.newton_schulz(batch)
            start = 0
            for k in ks:
                count = full[k].numel() // (full[k].shape[-2] * full[k].shape[-1])
                out[k] = res[start : start + count].view(full[k].shape)
                start += count
        return out

    def run(self, layouts: list[ShardLayout], inputs: list[torch.Tensor], config=None,
            splits=None) -> list[torch.Tensor]:
        """inputs: local fp32 NS inputs in view coordinates -> local fp32 NS outputs (raw, or QKV parts
        scaled as :meth:`_ns` says), orthogonalized with ``config`` (None: the orthogonalizer's own; a
        param group's settings may differ from it); ``splits[k]``: input k's QKVSplit or None."""
        splits = [None] * len(inputs) if splits is None else splits
        outputs: list[torch.Tensor | None] = [None] * len(inputs)
        routes: dict[tuple, list[int]] = {}
        for k, lay in enumerate(layouts):
            self.matrices[lay.kind] += 1
            if lay.kind == "owner":
                routes.setdefault(lay.route.key, []).append(k)
            else:
                outputs[k] = self._gather_one(lay, inputs[k], config, splits[k])
        for ks in routes.values():
            self._owner(ks, layouts, inputs, outputs, config, splits)
        return outputs

    def _gather_one(self, lay: ShardLayout, x: torch.Tensor, config=None, split=None) -> torch.Tensor:
        shape = lay.view_shape
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        full = DTensor.from_local(x, lay.mesh, lay.placements, run_check=False, shape=torch.Size(shape),
                                  stride=stride).full_tensor()
        sharding = sorted({i for dims in lay.shard_dims.values() for i in dims}, reverse=True)
        collectives.count_dtensor_gather(x, [lay.mesh.size(i) for i in sharding])
        out = self._ns([full], config, [split])[0]
        return distribute_tensor(out, lay.mesh, lay.placements, src_data_rank=None).to_local()

    def _owner(self, ks: list[int], layouts, inputs, outputs, config=None, splits=None) -> None:
        """Owner mode for matrices of one route: shards to the owner, NS there, parts back."""
        # Same-shape matrices next to each other, so that an owner's matrices of a chunk batch.
        ks = sorted(ks, key=lambda k: (layouts[k].view_shape[-2:], k))
        lays = [layouts[k] for k in ks]
        route = lays[0].route
        chunks, owners = assign_owners([ns_flops(lay.region[1]) for lay in lays], route.size,
                                       ITEMS_PER_RANK * route.size, self.loads.setdefault(route.key, [0.0] * route.size))

        def box_numel(i, s):
            return math.prod(lays[i].boxes[s][1])

        def to_owner(i, s):  # replica_work="split": only the owner's replica sends it the matrix
            return box_numel(i, s) if lays[i].sends_to_owner(s, owners[i]) else 0

        def in_region(i, s):  # member s's box within the region its route holds
            (offset, size), origin = lays[i].boxes[s], lays[i].region[0]
            return tuple(o - r for o, r in zip(offset, origin)), size

        def assemble(owned, pieces):
            full = []
            for i, parts in zip(owned, pieces):
                matrix = inputs[ks[i]].new_empty(lays[i].region[1])
                for s, piece in enumerate(parts):
                    if lays[i].sends_to_owner(s, owners[i]):
                        box = in_region(i, s)
                        matrix[_slices(box)] = piece.view(box[1])
                full.append(matrix)
            return self._ns(full, config, None if splits is None else [splits[ks[i]] for i in owned])

        def deliver(i, piece):
            outputs[ks[i]] = piece.view(inputs[ks[i]].shape)

        self.bytes_sent += OwnerExchange(
            route, chunks, owners,
            to_owner=to_owner,
            send=lambda i: inputs[ks[i]],
            compute=assemble,
            from_owner=box_numel,
            back=lambda i, result, s: result[_slices(in_region(i, s))],
            deliver=deliver,
            like=inputs[ks[0]],
        ).run()


def _reduce_dims(tensors, layouts, view_dims) -> None:
    """Sums tensors[k] in place over the mesh dims that shard view dims view_dims[k] of layouts[k]
    (one all-reduce per mesh group; replicated mesh dims hold equal values and are left alone)."""
    by_group: dict[int, tuple[Any, list[int]]] = {}
    for k, (lay, vd) in enumerate(zip(layouts, view_dims)):
        for i in sorted({i for d in vd for i in lay.shard_dims.get(d, ())}):
            g = lay.mesh.get_group(i)
            by_group.setdefault(id(g), (g, []))[1].append(k)
    for g, ks in by_group.values():
        flat = torch.cat([tensors[k].reshape(-1) for k in ks])
        collectives.all_reduce(flat, group=g)
        for k, chunk in zip(ks, flat.split([tensors[k].numel() for k in ks])):
            tensors[k].copy_(chunk.view_as(tensors[k]))


def _matrix_dims(lay: ShardLayout) -> tuple[int, int]:
    nd = len(lay.view_shape)
    return (nd - 2, nd - 1)


def sharded_normuon_(updates, moment2, layouts, normuon_dims, *, beta2, eps, found_inf=None) -> None:
    """NorMuon (docs/design.md §4.7) on local (E, m, n) views of sharded matrices, statistics of the full ones.

    moment2[k] is the (E, m, 1) or (E, 1, n) local view; normuon_dims[k] is -1 or -2.
    """
    sums = [u.square().sum(dim=nd, keepdim=True) for u, nd in zip(updates, normuon_dims)]
    _reduce_dims(sums, layouts, [(len(l.view_shape) + nd,) for l, nd in zip(layouts, normuon_dims)])
    eps32 = eps.to(torch.float32)
    norms, steps = [], []
    for u, v, s, lay, nd in zip(updates, moment2, sums, layouts, normuon_dims):
        mean = s / lay.view_shape[nd]
        new_v = torch.lerp(v.float(), mean, (1 - beta2).to(mean.dtype))
        v.copy_(new_v if found_inf is None else torch.where(found_inf != 0, v, new_v))
        step = u * new_v.clamp_min(eps32).rsqrt()
        norms.append(torch.stack([u.square().sum(dim=(-2, -1)), step.square().sum(dim=(-2, -1))]))
        steps.append(step)
    _reduce_dims(norms, layouts, [_matrix_dims(l) for l in layouts])
    for u, step, n in zip(updates, steps, norms):
        u.copy_(step * (n[0].sqrt() / n[1].sqrt().clamp_min(eps32))[:, None, None])


def sharded_namo_(updates, moment2, grads, ns_inputs, layouts, *, beta2, eps, grad_scale=None, found_inf=None) -> None:
    """NAMO (docs/design.md §4.7) on local (E, m, n) views of sharded matrices; moment2[k] is the (E,) view."""
    sums = [torch.stack([g.float().square().sum(dim=(-2, -1)), x.square().sum(dim=(-2, -1))])
            for g, x in zip(grads, ns_inputs)]
    _reduce_dims(sums, layouts, [_matrix_dims(l) for l in layouts])
    eps32 = eps.to(torch.float32)
    for u, v, s in zip(updates, moment2, sums):
        grad_sq = s[0] if grad_scale is None else s[0] / grad_scale.float().square()
        new_v = torch.lerp(v.float(), grad_sq, (1 - beta2).to(grad_sq.dtype))
        v.copy_(new_v if found_inf is None else torch.where(found_inf != 0, v, new_v))
        u.mul_((s[1].sqrt() / (new_v.sqrt() + eps32))[:, None, None])
