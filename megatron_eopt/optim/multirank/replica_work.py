"""``replica_work="auto"``: whether the replicas of a mesh (HSDP's replicate dim) share the
Newton–Schulz of every matrix (``"split"``) or each repeat it (``"repeat"``), by the planner's time
model (``multirank.hardware``; ``megatron_eopt.plan`` models whole steps with it).

The model, as the planner's: a matrix's owner runs its Newton–Schulz (the profile's rate, lower for
small matrices) and sends the other holders their parts of the fp32 result. "repeat" balances the
owners over the S ranks of a replica, each sending (S - 1)/S of the matrix over the replica's links;
"split" over all R·S ranks, each sending (R·S - 1)/S of it over links that span the replicas (the
network once they leave a node); every rank sends its shard of a matrix to the matrix's owner (in
"split" only to owners of its own replica, a 1/R share). The busiest rank decides (owners go largest first to the least
loaded rank): "split" divides the Newton–Schulz by R while there are matrices for every rank, and
costs R copies of a result from its owner, which at a thousand GPUs outweighs it (Llama-3 8B:
"split" on 64 H100s, "repeat" on 256 and 1,024, as ``megatron_eopt.plan`` picks; the suite checks
that the two agree on its presets).

The choice depends only on the global shapes, the placements, the mesh sizes, the precision and
the device's profile, so every rank of a mesh makes the same one (the plan's agreement checks it).
"""

from __future__ import annotations

import heapq
import math

import torch

from ...step_stats import newton_schulz_flops
from ..matrix_view import batched_matrix_shape, not_a_matrix
from .dtensor_layout import placement_kind
from .hardware import Hardware, hardware_of, ns_seconds


def _replicas_of(p, nd_mode: str) -> tuple[int, int, int] | None:
    """(replicas, shard ranks, batch split) of a DTensor matrix: the products of the sizes of the
    mesh dims that replicate it, that shard its matrix dims and that shard its batch of matrices
    (MoE experts over EP); None when ``"split"`` cannot hold for it (strided shards)."""
    mesh, placements = p.device_mesh, tuple(p.placements)
    nd = len(p.shape)
    shards = 1
    replicas = 1
    batch_split = 1
    for i, pl in enumerate(placements):
        size = mesh.size(i)
        kind = placement_kind(pl)
        if kind == "replicate":
            replicas *= size
        elif kind in ("shard", "strided"):
            if kind == "strided" or pl.dim < 0:
                return None  # describe() refuses "split" for such placements, even on a dim of one rank
            if size == 1:
                continue
            dim = pl.dim % nd
            # the dims of the view's matrices: the last two (nd_mode "batch": the leading ones index
            # matrices), or dim 0 of a flattened N-D param
            if (nd == 2 or nd_mode == "batch") and dim >= nd - 2 or nd > 2 and nd_mode == "flatten" and dim == 0:
                shards *= size
            elif nd_mode == "batch":
                batch_split *= size
    return replicas, shards, batch_split


def choose_replica_work(params_and_modes, precision: str, steps: int, hardware: Hardware | None = None) -> str:
    """``"split"`` or ``"repeat"`` for the DTensor matrices of ``params_and_modes`` ((param,
    nd_mode) pairs; plain tensors and non-matrices are skipped) at ``precision`` and ``steps``
    iterations; ``hardware`` defaults to each matrix's device's profile."""
    groups: dict[tuple, list[tuple[float, float]]] = {}  # (shard ranks, replicas, hw) -> (NS s, bytes) per matrix
    profiles: dict[str, Hardware] = {}
    for p, nd_mode in params_and_modes:
        if not hasattr(p, "device_mesh") or not_a_matrix(p, nd_mode):
            continue
        found = _replicas_of(p, nd_mode)
        if found is None:
            return "repeat"  # one matrix that cannot share its owner: the replicas repeat, every one alike
        replicas, shards, batch_split = found
        if replicas == 1 or shards == 1:
            continue
        hw = hardware or hardware_of(p.device)
        view = batched_matrix_shape(tuple(p.shape), nd_mode)
        (m, n), batch = view[-2:], -(-math.prod(view[:-2]) // batch_split)
        # one owner per parameter: the matrices of its batch that one rank's slice holds (its EP experts)
        t = batch * ns_seconds(hw, newton_schulz_flops(m, n, steps), precision)
        profiles[hw.name] = hw
        groups.setdefault((shards, replicas, hw.name), []).append((t, batch * 4.0 * m * n))
    repeat = split = 0.0
    for (shards, replicas, name), matrices in groups.items():
        hw = profiles[name]
        # repeat: owners among a replica's ranks, each sending the other shards of its result back
        # over the replica's links; split: owners among all ranks, each sending every other rank
        # of every replica its part, over links that span the replicas
        within = hw.nvlink_gbps if shards <= hw.gpus_per_node else hw.network_gbps
        across = hw.nvlink_gbps if shards * replicas <= hw.gpus_per_node else hw.network_gbps
        # and every rank sends its shard of each matrix to the owner (in split mode: an owner of its replica)
        shard_bytes = sum(b for _, b in matrices) / shards * (shards - 1) / shards
        repeat += _busiest([t + (shards - 1) / shards * b / (within * 1e9) for t, b in matrices], shards) \
            + shard_bytes / (within * 1e9)
        split += _busiest([t + (shards * replicas - 1) / shards * b / (across * 1e9) for t, b in matrices],
                          shards * replicas) + shard_bytes / replicas / (across * 1e9)
    return "split" if split < repeat else "repeat"


def _busiest(costs: list[float], ranks: int) -> float:
    """The busiest rank's time when the matrices of ``costs`` go, largest first, to the least loaded
    of ``ranks`` ranks (as the owner assignment balances them)."""
    loads = [0.0] * min(ranks, len(costs))
    heapq.heapify(loads)
    for cost in sorted(costs, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + cost)
    return max(loads, default=0.0)


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
