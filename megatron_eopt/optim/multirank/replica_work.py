"""``replica_work="auto"``: whether the replicas of a mesh (HSDP's replicate dim) share the
Newton–Schulz of every matrix (``"split"``) or each repeat it (``"repeat"``), by the planner's time
model (``multirank.hardware``; ``megatron_eopt.plan`` models whole steps with it).

The two differ by what a matrix of R replicas costs beyond the shard exchange both make: "repeat"
runs its Newton–Schulz R times in the mesh, "split" once and sends the fp32 result from its owner
to the R - 1 other replicas' ranks (the result's bytes once per other replica). Owners are balanced
over the ranks in both, so the mesh-wide sums compare as the busiest rank's do: "split" when the
Newton–Schulz time it saves, (R - 1)·t_NS, exceeds the sending it adds, (R - 1)·bytes / bandwidth,
summed over the sharded matrices. With the shipped profiles that is "split" for matrices of every
size: a Newton–Schulz costs at least the profile's small-matrix floor (half efficiency at
``half_gflop``) and grows as the cube of the side, its result's bytes as the square; "repeat" wins
on links slow against the device's Newton–Schulz (e.g. a profile with a few GB/s between replicas
of fast GPUs).

The choice depends only on the global shapes, the placements, the mesh sizes, the precision and
the device's profile, so every rank of a mesh makes the same one (the plan's agreement checks it).
"""

from __future__ import annotations

import math

import torch

from ...step_stats import newton_schulz_flops
from ..matrix_view import matrix_view, not_a_matrix
from .hardware import Hardware, hardware_of, ns_seconds


def _replicas_of(p, nd_mode: str) -> int | None:
    """The replicas among which a DTensor matrix's owner could be shared: the product of the mesh
    dims that replicate it, when other dims shard its matrix dims with plain shards (1: nothing to
    share); None when ``"split"`` cannot hold for it (strided shards)."""
    mesh, placements = p.device_mesh, tuple(p.placements)
    nd = len(p.shape)
    matrix_dims = set()
    replicas = 1
    for i, pl in enumerate(placements):
        size = mesh.size(i)
        if type(pl).__name__ == "Replicate":
            replicas *= size
        elif hasattr(pl, "dim"):
            if type(pl).__name__ != "Shard" or pl.dim < 0:
                return None  # describe() refuses "split" for such placements, even on a dim of one rank
            if size == 1:
                continue
            dim = pl.dim % nd
            # the dims of the view's matrices: the last two (nd_mode "batch": the leading ones index
            # matrices), or dim 0 of a flattened N-D param
            if (nd == 2 or nd_mode == "batch") and dim >= nd - 2 or nd > 2 and nd_mode == "flatten" and dim == 0:
                matrix_dims.add(dim)
    return replicas if matrix_dims else 1


def choose_replica_work(params_and_modes, precision: str, steps: int, hardware: Hardware | None = None) -> str:
    """``"split"`` or ``"repeat"`` for the DTensor matrices of ``params_and_modes`` ((param,
    nd_mode) pairs; plain tensors and non-matrices are skipped) at ``precision`` and ``steps``
    iterations; ``hardware`` defaults to the first matrix's device's profile."""
    saved = added = 0.0
    for p, nd_mode in params_and_modes:
        if not hasattr(p, "device_mesh") or not_a_matrix(p, nd_mode):
            continue
        replicas = _replicas_of(p, nd_mode)
        if replicas is None:
            return "repeat"  # one matrix that cannot share its owner: the replicas repeat, every one alike
        if replicas == 1:
            continue
        hw = hardware or hardware_of(p.device)
        view = matrix_view(tuple(p.shape), nd_mode)
        batch, (m, n) = math.prod(view[:-2]), view[-2:]
        link = hw.nvlink_gbps if p.device_mesh.size() <= hw.gpus_per_node else hw.network_gbps
        saved += (replicas - 1) * batch * ns_seconds(hw, newton_schulz_flops(m, n, steps), precision)
        added += (replicas - 1) * batch * 4 * m * n / (link * 1e9)
    return "split" if saved > added else "repeat"


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
