"""``replica_work="auto"``: whether the replicas of a mesh (HSDP's replicate dim, and the mesh dims
that replicate a matrix: EP for dense weights, TP for the weights it does not shard) share the
Newton–Schulz of every matrix (``"split"``) or each repeat it (``"repeat"``), by the cost model
(``multirank.cost_model``), which the planner (``megatron_eopt.plan``) reports per rank.

The optimizer's DTensor matrices become the model's matrices (:class:`~.cost_model.Placed`: the
matrix view, the mesh dims that shard its matrix dims, those that replicate it) on the model's mesh
(sizes and the ranks' strides, :func:`~.cost_model.mesh_shape_of`), and the model's owner step runs
in both modes (:func:`~.cost_model.owner_step`): per route, owners balanced by FLOPs, two
all-to-alls per chunk of matrices, each costing its latency and its bytes over the link its ranks
span. The busiest rank decides, "repeat" on a tie. The planner adds only its workspace chunks of the
step, which change which matrices share an exchange, not what either mode sends or computes.

The choice depends only on the global shapes, the placements, the mesh, the precision and the
device's profile, so every rank of a mesh makes the same one (the plan's agreement checks it).
"""

from __future__ import annotations

import math

import torch

from ..matrix_view import batched_matrix_shape, not_a_matrix
from .cost_model import MeshShape, Placed, busiest_seconds, mesh_shape_of, owner_step
from .dtensor_layout import _view_dim, chunk_extent, placement_kind
from .hardware import Hardware, hardware_of


def placed_of(p, nd_mode: str) -> Placed | None:
    """The cost model's view of DTensor matrix ``p``: its matrix view (the batch of one rank's slice
    where mesh dims shard its leading dims: MoE experts over EP), the mesh dims that shard its matrix
    dims and those that replicate it; None when ``"split"`` cannot hold for it (strided or negative-
    dim shards, other placements: describe() refuses "split" for them, even on a dim of one rank)."""
    mesh, placements = p.device_mesh, tuple(p.placements)
    shape = list(p.shape)
    view = list(batched_matrix_shape(tuple(shape), nd_mode))
    shards, replicas = [], []
    for i, pl in enumerate(placements):
        size, kind = mesh.size(i), placement_kind(pl)
        if kind == "replicate":
            if size > 1:
                replicas.append(i)
            continue
        if kind != "shard" or pl.dim < 0:
            return None
        if size == 1:
            continue
        nd, nv = len(shape), len(view)
        dim = pl.dim % nd
        if nv == 2 and nd > 2 and dim != 0:
            return None  # nd_mode "flatten" sharded off dim 0: describe() refuses it
        if nv == 2 or dim >= nd - 2:
            shards.append((i, _view_dim(nd, nv, dim)))
        else:  # a leading dim (experts): one rank's slice of the batch
            shape[dim] = chunk_extent(shape[dim], size, 0)[1]
            view[0] = math.prod(shape[:-2])
    return Placed(tuple(view), tuple(shards), tuple(replicas))


def choose_replica_work(params_and_modes, precision: str, steps: int, hardware: Hardware | None = None) -> str:
    """``"split"`` or ``"repeat"`` for the DTensor matrices of ``params_and_modes`` ((param,
    nd_mode) pairs; plain tensors and non-matrices are skipped) at ``precision`` and ``steps``
    iterations; ``hardware`` defaults to the first matrix's device's profile. Matrices on several
    meshes: each mesh's busiest rank, added."""
    meshes: dict[int, tuple[MeshShape, list[Placed]]] = {}
    hw = hardware
    for p, nd_mode in params_and_modes:
        if not hasattr(p, "device_mesh") or not_a_matrix(p, nd_mode):
            continue
        placed = placed_of(p, nd_mode)
        if placed is None:
            return "repeat"  # one matrix that cannot share its owner: the replicas repeat, every one alike
        hw = hw or hardware_of(p.device)
        key = id(p.device_mesh)
        if key not in meshes:
            meshes[key] = (mesh_shape_of(p.device_mesh, len(p.placements)), [])
        meshes[key][1].append(placed)
    repeat = split = 0.0
    for mesh, entries in meshes.values():
        if any(e.shards and e.replicas for e in entries):  # else both modes run the same step
            repeat += busiest_seconds(owner_step(entries, mesh, False, hw, precision, steps))
            split += busiest_seconds(owner_step(entries, mesh, True, hw, precision, steps))
    return "split" if split < repeat else "repeat"


def resolve_replica_work(replica_work: str, sharded_mode: str, param_groups, nd_mode: str, precision: str,
                         steps: int) -> str:
    """The optimizer's ``replica_work`` as its plan uses it: ``"auto"`` resolved (gather mode has no
    owners to share: ``"repeat"``)."""
    if replica_work != "auto":
        return replica_work
    if sharded_mode != "owner":
        return "repeat"
    pairs = [(p, g.get("nd_mode", nd_mode)) for g in param_groups for p in g["params"]]
    if not any(hasattr(p, "device_mesh") for p, _ in pairs):
        return "repeat"
    with torch.no_grad():
        return choose_replica_work(pairs, precision, steps)
