"""Orthogonalization of sharded DTensor matrices (FSDP2, tensor parallel, HSDP): ``ShardedOrthogonalizer``.

The elementwise part of a step (momentum, decay, update, AdaMuon) runs on ``to_local()`` views
through the fused ops; only Newton–Schulz and the NorMuon / NAMO statistics need the whole
matrix. Each matrix's layout (``dtensor_layout.describe``) picks one of two modes:

- ``owner`` (default): every full matrix gets one owner rank among the ranks that shard it,
  balanced by Newton–Schulz FLOPs; its shards travel to the owner, which runs one batched
  Newton–Schulz per shape, and each rank gets its part of the result back, chunk by chunk and
  pipelined (``owner_exchange``: the routes, the all-to-alls, the owners' balance).
- ``gather``: the reference. Each matrix is all-gathered by DTensor (``full_tensor``), every
  rank orthogonalizes it and keeps its part. Also the fallback for placements without a
  rectangular box per rank (e.g. FSDP2's strided shards over tensor parallelism).

Matrices whose matrix dims are not sharded need no communication: they join the ordinary batched
stacks. The statistics reductions are ``sharded_statistics``'.
"""

from __future__ import annotations

import math

import torch

from ... import _collectives as collectives
from ..matrix_view import split_newton_schulz
from .dtensor_layout import DTensor, ShardLayout, distribute_tensor
from .owner_exchange import ITEMS_PER_RANK, OwnerExchange, assign_owners, ns_flops

SHARDED_MODES = ("owner", "gather")


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
        # The step's first exchange (multirank.riding.FirstExchange), set by the optimizer for one step
        # and handed to the first owner exchange that runs.
        self.first_exchange = None

    def _ns(self, full: list[torch.Tensor], config=None, splits=None) -> list[torch.Tensor]:
        """One batched Newton–Schulz per matrix shape over 2-D (m, n) and 3-D (E, m, n) tensors, with
        ``config`` (None: the orthogonalizer's own). ``splits[k]``: the MatrixSplit of a fused
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
            splits=None, loads: dict | None = None) -> list[torch.Tensor]:
        """inputs: local fp32 NS inputs in view coordinates -> local fp32 NS outputs (raw, or QKV parts
        scaled as :meth:`_ns` says), orthogonalized with ``config`` (None: the orthogonalizer's own; a
        param group's settings may differ from it); ``splits[k]``: input k's MatrixSplit or None.
        ``loads``: each route's members' Newton–Schulz FLOPs so far (keyed by ``route.key``, updated
        in place; see :func:`charge_owner_loads`); None: every member starts at zero."""
        splits = [None] * len(inputs) if splits is None else splits
        loads = {} if loads is None else loads
        outputs: list[torch.Tensor | None] = [None] * len(inputs)
        for k, lay in enumerate(layouts):
            self.matrices[lay.kind] += 1
            if lay.kind != "owner":
                outputs[k] = self._gather_one(lay, inputs[k], config, splits[k])
        for ks in owner_routes(layouts).values():
            self._owner(ks, layouts, inputs, outputs, config, splits, loads)
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

    def _owner(self, ks: list[int], layouts, inputs, outputs, config, splits, loads: dict) -> None:
        """Owner mode for matrices of one route: shards to the owner, NS there, parts back."""
        ks, chunks, owners = _owners(ks, layouts, loads)
        lays = [layouts[k] for k in ks]
        route = lays[0].route

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
            first=self._take_first_exchange(),
        ).run()

    def _take_first_exchange(self):
        first, self.first_exchange = self.first_exchange, None
        return first


def owner_routes(layouts: list[ShardLayout]) -> dict[tuple, list[int]]:
    """The owner-mode layouts' indices by route (``route.key``), in order of first appearance: one
    exchange each."""
    routes: dict[tuple, list[int]] = {}
    for k, lay in enumerate(layouts):
        if lay.kind == "owner":
            routes.setdefault(lay.route.key, []).append(k)
    return routes


def _owners(ks: list[int], layouts, loads: dict) -> tuple[list[int], list[list[int]], list[int]]:
    """One route's matrices ``ks`` in exchange order (same-shape matrices next to each other, so
    that an owner's matrices of a chunk batch), the exchange's chunks and each matrix's owner,
    balanced from ``loads[route.key]`` (updated)."""
    ks = sorted(ks, key=lambda k: (layouts[k].view_shape[-2:], k))
    route = layouts[ks[0]].route
    chunks, owners = assign_owners([ns_flops(layouts[k].region[1]) for k in ks], route.size,
                                   ITEMS_PER_RANK * route.size, loads.setdefault(route.key, [0.0] * route.size))
    return ks, chunks, owners


def charge_owner_loads(layouts: list[ShardLayout], loads: dict) -> None:
    """What :meth:`ShardedOrthogonalizer.run` of these layouts adds to ``loads``, without running
    anything (the step's owner balance, planned chunk by chunk: ``step.balance``)."""
    for ks in owner_routes(layouts).values():
        _owners(ks, layouts, loads)
