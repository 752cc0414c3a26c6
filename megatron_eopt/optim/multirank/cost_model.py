"""The cost model: what the pieces of a step cost on a hardware profile (``multirank.hardware``).

One model for every decision that weighs Newton–Schulz against communication:
``replica_work="auto"`` (``multirank.replica_work``), tp_mode "auto" (:func:`auto_tp_mode`, after
Megatron-LM PR #6664) and the planner (``megatron_eopt.plan``), which reports it per rank.

- A matrix's Newton–Schulz (:func:`newton_schulz_seconds`): its FLOPs (``step_stats.
  newton_schulz_flops``, the one FLOP formula) at the profile's rate for the precision, reduced for
  small matrices (half the rate at ``half_gflop``).
- A collective (:func:`collective_seconds`): the profile's latency plus the bytes this rank sends
  over the link its group spans: NVLink while the block of consecutive ranks the group lies in (its
  outermost mesh dim's stride times that dim's size, :meth:`MeshShape.span`) fits a node, else the
  network.
- Owner mode's step (:func:`owner_step`): the owner exchange simulated by the step's own rules
  (routes by mesh dims, owners balanced by ``assign_owners`` over chunks of ``ITEMS_PER_RANK``
  matrices per member, two all-to-alls per chunk, DTensor's chunking of each member's shard), per
  rank; compute and communication add (no overlap assumed). The busiest rank decides.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ...step_stats import StepStats, newton_schulz_flops
from .dtensor_layout import chunk_extent
from .hardware import Hardware
from .owner_exchange import ITEMS_PER_RANK, assign_owners, ns_flops


# ------------------------------------------------------------------ the two primitives
def newton_schulz_seconds(hw: Hardware, flops_per_matrix: float, precision: str) -> float:
    """Modelled seconds of one matrix's Newton–Schulz of ``flops_per_matrix`` FLOPs: the profile's
    rate, reduced for small matrices (half of it at ``half_gflop``)."""
    if flops_per_matrix <= 0:
        return 0.0
    rate = hw.tflops[precision] * 1e12 * flops_per_matrix / (flops_per_matrix + hw.half_gflop * 1e9)
    return flops_per_matrix / rate


ns_seconds = newton_schulz_seconds  # the name the planner and tp_mode "auto" used first


def link_gbps(hw: Hardware, span: int) -> float:
    """GB/s (a direction) of a collective whose ranks lie within ``span`` consecutive ranks: NVLink
    while they fit a node, else the network."""
    return hw.nvlink_gbps if span <= hw.gpus_per_node else hw.network_gbps


def collective_seconds(hw: Hardware, nbytes: float, span: int) -> float:
    """Modelled seconds of one collective in which this rank sends ``nbytes`` over a group of ``span``
    (:meth:`MeshShape.span`): the profile's latency plus the bytes over the group's link."""
    return hw.latency_us * 1e-6 + nbytes / (link_gbps(hw, span) * 1e9)


# ------------------------------------------------------------------ meshes and matrices as the model sees them
def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """The rank strides of a mesh laid out row-major over consecutive ranks (init_device_mesh's)."""
    out, stride = [], 1
    for s in reversed(sizes):
        out.append(stride)
        stride *= s
    return tuple(reversed(out))


def group_span(ranks: Sequence[int]) -> int:
    """:meth:`MeshShape.span` of a process group from its (global) ranks, evenly strided as a mesh
    dim's groups are: its stride times its size."""
    ranks = sorted(ranks)
    if len(ranks) < 2:
        return 1
    return (ranks[-1] - ranks[0]) // (len(ranks) - 1) * len(ranks)


@dataclass(frozen=True)
class MeshShape:
    """A device mesh: its dims' sizes and rank strides, outermost first (row-major by default)."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.strides:
            object.__setattr__(self, "strides", row_major_strides(self.sizes))

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def span(self, dims) -> int:
        """The consecutive ranks the groups of a collective over mesh ``dims`` lie in: the largest
        stride times size among them (dims of one rank moved nothing and are left out)."""
        return max((self.strides[d] * self.sizes[d] for d in dims if self.sizes[d] > 1), default=1)


def mesh_shape_of(mesh, ndim: int) -> MeshShape:
    """The :class:`MeshShape` of an ``ndim``-dim DeviceMesh: strides read from its ranks (a mesh
    sliced out of a larger one keeps its ranks' real distances), row-major where it holds no rank
    tensor."""
    sizes = tuple(mesh.size(i) for i in range(ndim))
    ranks = getattr(mesh, "mesh", None)
    if ranks is None:
        return MeshShape(sizes)
    origin = int(ranks[(0,) * ndim])
    strides = [abs(int(ranks[tuple(int(j == i) for j in range(ndim))]) - origin) if s > 1 else stride
               for i, (s, stride) in enumerate(zip(sizes, row_major_strides(sizes)))]
    return MeshShape(sizes, tuple(strides))


@dataclass(frozen=True)
class Placed:
    """One matrix (or one rank's slice of an expert batch) in owner mode. ``view``: its matrix view,
    the batch one rank's slice holds and the matrix dims whole; ``shards``: (mesh dim, view dim) for
    each mesh dim of more than one rank that shards a matrix dim, in mesh-dim order; ``replicas``:
    the mesh dims of more than one rank that replicate it (``replica_work="split"`` shares them)."""

    view: tuple[int, ...]
    shards: tuple[tuple[int, int], ...] = ()
    replicas: tuple[int, ...] = ()


@dataclass(eq=False)
class RankCost(StepStats):
    """A rank's modelled step: what ``step_stats()`` counts of it, and the modelled seconds of its
    communication (collectives' latency and bytes over their links) and Newton–Schulz."""

    comm_s: float = 0.0
    compute_s: float = 0.0


COST_FIELDS = ("ns_matrices", "ns_flops", "bytes_sent", "collectives", "comm_s", "compute_s")


def charge_collective(rank, nbytes: int, span: int, hw: Hardware) -> None:
    """One collective on ``rank`` (a :class:`RankCost` or alike), sending ``nbytes``."""
    rank.collectives += 1
    rank.bytes_sent += nbytes
    rank.comm_s += collective_seconds(hw, nbytes, span)


def charge_newton_schulz(rank, view: tuple[int, ...], steps: int, hw: Hardware, precision: str) -> None:
    """The Newton–Schulz of the matrices of ``view`` (..., m, n) on ``rank``."""
    batch = math.prod(view[:-2])
    flops = batch * newton_schulz_flops(view[-2], view[-1], steps)
    rank.ns_matrices += batch
    rank.ns_flops += flops
    if flops:
        rank.compute_s += batch * newton_schulz_seconds(hw, flops / batch, precision)


def add_costs(into, other, fields: Sequence[str] = COST_FIELDS) -> None:
    for f in fields:
        setattr(into, f, getattr(into, f) + getattr(other, f))


def seconds_of(rank) -> float:
    return rank.compute_s + rank.comm_s


# ------------------------------------------------------------------ owner mode's step
def owner_step(entries: Sequence[Placed], mesh: MeshShape, split: bool, hw: Hardware, precision: str, steps: int,
               chunks: Sequence[Sequence[int]] | None = None, new: Callable[[], object] = RankCost) -> list:
    """Every rank's modelled owner-mode step (``replica_work`` "split" or "repeat"), in the mesh's
    rank order (coordinates row-major): per step chunk of ``entries`` (indices, in parameter order;
    None: one chunk), one owner exchange per route (the mesh dims of the matrices' shards, and with
    ``split`` those that replicate them), every route instance alike by symmetry, owners' loads
    carried over the chunks; matrices whose matrix dims are whole (replicated, experts sharded on
    their batch) orthogonalized where they lie, on every rank."""
    members: dict[tuple, list] = {}  # route dims -> per member (row-major over the dims) counts
    loads: dict[tuple, list[float]] = {}  # route dims -> members' FLOPs so far in the step
    for chunk in (range(len(entries)),) if chunks is None else chunks:
        routes: dict[tuple, list[Placed]] = {}
        for i in chunk:
            e = entries[i]
            if e.shards:
                dims = {d for d, _ in e.shards} | (set(e.replicas) if split else set())
                routes.setdefault(tuple(sorted(dims)), []).append(e)
        for dims, es in routes.items():
            size = math.prod(mesh.sizes[d] for d in dims)
            counts = members.setdefault(dims, [new() for _ in range(size)])
            _exchange(es, dims, mesh, counts, loads.setdefault(dims, [0.0] * size), hw, precision, steps)
    where_they_lie = new()
    for e in entries:
        if not e.shards:
            charge_newton_schulz(where_they_lie, e.view, steps, hw, precision)
    out = []
    for c in itertools.product(*(range(s) for s in mesh.sizes)):
        r = new()
        add_costs(r, where_they_lie)
        for dims, counts in members.items():
            add_costs(r, counts[_member(tuple(c[d] for d in dims), [mesh.sizes[d] for d in dims])])
        out.append(r)
    return out


def _member(coords: Sequence[int], sizes: Sequence[int]) -> int:
    index = 0
    for c, s in zip(coords, sizes):
        index = index * s + c
    return index


def _exchange(entries: Sequence[Placed], dims: tuple, mesh: MeshShape, ranks: list, load: list[float],
              hw: Hardware, precision: str, steps: int) -> None:
    """One owner exchange over a route (``ShardedOrthogonalizer._owner``): its matrices sorted by
    shape, chunks of ITEMS_PER_RANK per member with owners by FLOPs, per chunk one all-to-all to the
    owners (each member sends its shard to the owner if of the owner's replica) and one back (the
    owner sends every other member its part)."""
    sizes = [mesh.sizes[d] for d in dims]
    size = math.prod(sizes)
    members = list(itertools.product(*(range(s) for s in sizes)))
    entries = sorted(entries, key=lambda e: e.view[-2:])  # stable: by shape, then in order
    chunks, owners = assign_owners([ns_flops(e.view) for e in entries], size, ITEMS_PER_RANK * size, load)
    span = mesh.span(dims)
    for chunk in chunks:
        out = [0] * size
        back = [0] * size
        for k in chunk:
            e, o = entries[k], owners[k]
            at = [dims.index(d) for d, _ in e.shards]  # route positions of the sharding mesh dims
            boxes = {}  # shard coordinates -> bytes of that shard (alike on every replica)
            for sc in itertools.product(*(range(sizes[p]) for p in at)):
                shape = list(e.view)
                for (d, vd), c in zip(e.shards, sc):
                    shape[vd] = chunk_extent(shape[vd], mesh.sizes[d], c)[1]
                boxes[sc] = math.prod(shape) * 4
            mine = tuple(members[o][p] for p in at)
            for sc, nbytes in boxes.items():  # the owner's replica sends it the shards
                if sc != mine:
                    coords = list(members[o])
                    for p, c in zip(at, sc):
                        coords[p] = c
                    out[_member(coords, sizes)] += nbytes
            back[o] += sum(boxes.values()) * (size // len(boxes)) - boxes[mine]
            charge_newton_schulz(ranks[o], e.view, steps, hw, precision)
        for s in range(size):
            charge_collective(ranks[s], out[s], span, hw)
            charge_collective(ranks[s], back[s], span, hw)


def busiest_seconds(ranks: Sequence) -> float:
    return max((seconds_of(r) for r in ranks), default=0.0)


# ------------------------------------------------------------------ tp_mode "auto" (Megatron-LM PR #6664)
AUTO_CANDIDATES = ("duplicated", "distributed")


def auto_tp_mode_seconds(sharded: int, other: int, size: int, num_ns_steps: int, use_syrk: bool,
                         element_bytes: int, hw: Hardware, precision: str, span: int | None = None) -> dict[str, float]:
    """Modelled seconds of one step's orthogonalization of a matrix whose global side ``sharded`` is
    split over ``size`` ranks (``other`` the side that is whole), per mode of tp_mode "auto".

    Newton–Schulz by the one FLOP formula, as Megatron-LM's rule counts it (``use_syrk``: both Gram
    products halved by a symmetric kernel): duplicated on the whole matrix, its Gram on the short
    side (every rank the same); distributed on this rank's shard (DTensor's chunk of ``sharded`` by
    ``other``), whose Gram matrix is ``other`` square. Communication as a ring moves it, over the
    group's link (``span``: :func:`group_span` of its ranks; None: ``size``, consecutive ranks as
    Megatron builds its tensor-parallel groups): duplicated one all-gather of (size - 1) / size of the matrix; distributed one all-reduce of the
    norm and one of an ``other`` square Gram matrix per iteration, 2 (size - 1) / size of each."""
    flops = {
        "duplicated": newton_schulz_flops(sharded, other, num_ns_steps, symmetric_gram=use_syrk),
        "distributed": newton_schulz_flops(chunk_extent(sharded, size, 0)[1], other, num_ns_steps, gram_dim=1,
                                           symmetric_gram=use_syrk),
    }
    ring = (size - 1) / size
    span = size if span is None else span
    wire = {
        "duplicated": collective_seconds(hw, ring * sharded * other * element_bytes, span),
        "distributed": collective_seconds(hw, 2 * ring * element_bytes, span)
        + num_ns_steps * collective_seconds(hw, 2 * ring * other * other * element_bytes, span),
    }
    return {mode: newton_schulz_seconds(hw, flops[mode], precision) + wire[mode] for mode in AUTO_CANDIDATES}


def auto_tp_mode(sharded: int, other: int, size: int, num_ns_steps: int, use_syrk: bool, element_bytes: int,
                 hw: Hardware, precision: str, candidates: Sequence[str] = AUTO_CANDIDATES,
                 span: int | None = None) -> str:
    """tp_mode "auto"'s choice for one dense weight: the candidate of least modelled time
    (:func:`auto_tp_mode_seconds`), duplicated on a tie. A pure function of the global shape, the
    group's size, the step's settings and the hardware profile: every rank of a group decides alike."""
    if len(candidates) == 1:
        return candidates[0]
    seconds = auto_tp_mode_seconds(sharded, other, size, num_ns_steps, use_syrk, element_bytes, hw, precision, span)
    return min(candidates, key=lambda mode: (seconds[mode], AUTO_CANDIDATES.index(mode)))
