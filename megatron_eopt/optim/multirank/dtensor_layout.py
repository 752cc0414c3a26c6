"""DTensor (FSDP2, tensor parallel, HSDP) parameters: where each rank's shard lies in the full matrix.

A matrix's *layout* (``ShardLayout``, built by ``describe``) says how its matrix view is sharded:
which mesh dims shard which view dims, each rank's *box* (offset and shape per dim, from the
placements with DTensor's chunking rule, checked against the real local tensor), and how the
sharded Newton–Schulz will handle it: ``"local"`` (its matrix dims are not sharded: Replicate, or
MoE experts sharded on dim 0 in ``nd_mode="batch"``; it joins the ordinary batched stacks),
``"owner"`` (one rank orthogonalizes it; its route from ``owner_exchange``) or ``"gather"``
(all-gathered; also the fallback for placements without a rectangular box per rank, e.g. FSDP2's
strided shards over tensor parallelism). ``uneven_splits`` finds Megatron-FSDP's shards that do not
follow DTensor's chunking rule; ``statistic_placements`` and ``zeros_state`` place the NorMuon /
NAMO statistics of a sharded param. The orthogonalization itself is ``sharded``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ... import _collectives as collectives
from ..matrix_view import batched_matrix_shape
from .owner_exchange import OwnerRoute, _route_of

try:  # torch.distributed.tensor is public from torch 2.4; guarded for builds without distributed
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    try:
        from torch.distributed.tensor import Partial
    except ImportError:  # pragma: no cover
        from torch.distributed.tensor.placement_types import Partial
except ImportError:  # pragma: no cover
    DTensor = Replicate = Shard = Partial = distribute_tensor = None

# What the replicas of a matrix (mesh dims that replicate it: HSDP's replicate dim) do in owner mode:
# "repeat" orthogonalizes every matrix once per replica; "split" once in the whole mesh, its owner
# chosen among the ranks of every replica and its result sent to the ranks of all of them; "auto"
# picks one of them by the cost model (multirank.replica_work) when the plan is built.
REPLICA_WORK = ("auto", "repeat", "split")


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


def chunk_extent(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of part `index` of `size` split as torch.chunk / DTensor's Shard do."""
    full = -(-size // parts) if size else 0
    start = min(index * full, size)
    return start, max(0, min(full, size - start))


def placement_kind(pl) -> str:
    """What a DTensor placement does, in one place for every reader: ``"strided"`` (FSDP2's
    _StridedShard over tensor parallelism: a Shard subclass in some torch versions, not in others),
    ``"shard"`` (Shard), ``"replicate"``, or ``"other"`` (Partial, ...)."""
    if type(pl).__name__ == "_StridedShard" and hasattr(pl, "dim"):
        return "strided"
    if Shard is not None and isinstance(pl, Shard):
        return "shard"
    if Replicate is not None and isinstance(pl, Replicate):
        return "replicate"
    return "other"


def _is_shard(pl) -> bool:
    # Shard and _StridedShard both split a tensor dim `pl.dim` over a mesh dim.
    return placement_kind(pl) in ("shard", "strided")


def _box(shape, placements, coordinate, mesh_shape, uneven=None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (offset, size) of the shard at mesh ``coordinate``; ``uneven`` (mesh dim, sizes): the one
    sharding mesh dim's shards as the ranks hold them, in coordinate order (Megatron-FSDP's)."""
    offset, length = [0] * len(shape), list(shape)
    for i, pl in enumerate(placements):
        if placement_kind(pl) == "shard":
            d = pl.dim
            if uneven is not None and uneven[0] == i:
                sizes = uneven[1]
                start, n = sum(sizes[: coordinate[i]]), sizes[coordinate[i]]
            else:
                start, n = chunk_extent(length[d], mesh_shape[i], coordinate[i])
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
            rule = tuple(chunk_extent(p.shape[d], len(sizes), c)[1] for c in range(len(sizes)))
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
            exact = exact and placement_kind(pl) == "shard" and pl.dim >= 0
            if mesh.size(i) > 1:  # sharded over one rank: the whole dim is local, as if replicated
                shard_dims.setdefault(pl.dim % nd, []).append(i)
        elif placement_kind(pl) != "replicate":
            raise ValueError(f"{where} has an unsupported placement {pl} on mesh dim {i}")
    view = batched_matrix_shape(shape, nd_mode)
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
                         largest_view=batched_matrix_shape(_largest_shard(shape, placements, mesh, uneven), nd_mode),
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
        if tuple(mine) != batched_matrix_shape(tuple(p.to_local().shape), nd_mode):
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
                             if placement_kind(pl) == "replicate" and mesh.size(i) > 1)
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
                out[d] = chunk_extent(out[d], mesh.size(i), 0)[1]
    return tuple(out)


def _view_dim(param_ndim: int, view_ndim: int, d: int) -> int:
    """The matrix-view dim that param dim ``d`` lies in (merged dims: see batched_matrix_shape)."""
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
