"""One rank of test_step_stats.py's multi-rank counts (gloo, CPU)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from dist_harness import counted_collectives, gloo_world  # noqa: E402
from megatron_eopt.optim.multirank.agreement import AGREEMENT_BYTES  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402
from megatron_eopt.compat import snippet  # noqa: E402
from megatron_eopt import plan  # noqa: E402
from megatron_eopt.optim import Muon  # noqa: E402

SHAPES = [(16, 8), (16, 8), (8, 24), (6, 10), (12, 12)]
NAMES = ("all_reduce", "all_gather", "all_to_all_single", "all_gather_object")


def _sum(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def _grads(params, gen):
    for p in params:
        full = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else full


def _step(opt, params, gen, before_counted=lambda: None):
    """Two steps; the counters of the second (the first builds the plan and agrees on it across ranks)."""
    _grads(params, gen)
    opt.step()
    _grads(params, gen)
    before_counted()
    with counted_collectives(NAMES) as calls:
        opt.step()
    return opt.step_stats(), calls


def _agreements(mesh):
    """A step's agreement all-reduces (one per mesh dim of size > 1)."""
    return sum(1 for p in mesh.mesh.shape if p > 1)


def _agreement_bytes(mesh):
    """What a step's agreement between the ranks sends (one all-reduce per mesh dim of size > 1)."""
    return sum(2 * (p - 1) * AGREEMENT_BYTES // p for p in mesh.mesh.shape if p > 1)


def check_sharded(mesh, mode):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)])) for s in SHAPES]
    opt = Muon(params, lr=0.02, sharded_mode=mode)
    before = []
    stats, calls = _step(opt, params, torch.Generator().manual_seed(1), lambda: before.append(opt._sharded.bytes_sent))
    # the ranks' agreement before the step: one all-reduce per mesh dim, counted apart too
    assert (stats["agreements"], stats["agreement_bytes"]) == (_agreements(mesh), _agreement_bytes(mesh)), stats
    if mode == "owner":
        assert stats["collectives"] == sum(calls.values()), (mode, stats, calls)
        assert _sum(stats["ns_matrices"]) == len(SHAPES), stats
        # the owner exchange's own counter: the same bytes, and the ranks' agreement before the step
        assert stats["bytes_sent"] == opt._sharded.bytes_sent - before[0] + _agreement_bytes(mesh), stats
    else:  # every rank gathers every matrix (DTensor's own all-gather, one each) and orthogonalizes all
        assert stats["ns_matrices"] == len(SHAPES) == stats["collectives"] - _agreements(mesh), stats
        local = sum(p.to_local().numel() * 4 for p in params)
        assert stats["bytes_sent"] == local + _agreement_bytes(mesh), (stats, local)  # (2 - 1) x the local rows
    _planned(stats, [plan.Matrix(s) for s in SHAPES], plan.Mesh(dp_shard=mesh.size()), mode)


def _planned(stats, matrices, mesh, layout, workspace_mib=64):
    """The planner's counts of this rank equal what the step counted (megatron_eopt.plan); 64 MiB is
    "auto" on the CPU."""
    want = plan.rank_counts(matrices, mesh, layout, workspace_mib=workspace_mib)
    mine = want[dist.get_rank()] if len(want) > 1 else want[0]
    got = (stats["ns_matrices"], stats["ns_flops"], stats["bytes_sent"], stats["collectives"])
    assert got == (mine.ns_matrices, mine.ns_flops, mine.bytes_sent, mine.collectives), (layout, got, mine)


def check_legacy_dist_muon():
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    opt = snippet.DistMuon(params, lr=0.02)
    stats, calls = _step(opt, params, torch.Generator().manual_seed(3))
    assert _sum(stats["ns_matrices"]) == len(SHAPES), stats
    assert stats["collectives"] == sum(calls.values()) > 0 and stats["bytes_sent"] > 0, (stats, calls)


MANY = SHAPES + [(37, 24)] * 9 + [(5, 3), (3, 40)]  # several owner chunks; uneven and empty shards


def check_replica_work(grid):
    """HSDP (mesh replicate x shard, placements (Replicate, Shard)): replica_work="split" orthogonalizes
    each matrix once in the mesh, "repeat" once per replica; both give the same parameters. The
    planner's counts equal the step's, in one step chunk and in many (a small workspace budget)."""
    for shapes, workspace in ((SHAPES, "auto"), (MANY, "auto"), (MANY, 0.004)):
        finals = {}
        for work in ("repeat", "split", "auto"):
            gen = torch.Generator().manual_seed(4)
            params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), grid,
                                                           [Replicate(), Shard(i % 2)])) for i, s in enumerate(shapes)]
            opt = Muon(params, lr=0.02, replica_work=work, workspace_mib=workspace)
            # "auto" (the default): the CPU profile's Newton–Schulz outweighs sending the results
            used = opt._replica_work_in_use
            assert used == ("split" if work == "auto" else work), (work, used)
            stats, _ = _step(opt, params, torch.Generator().manual_seed(5))
            replicas = grid.size(0)
            assert _sum(stats["ns_matrices"]) == len(shapes) * (1 if used == "split" else replicas), (work, stats)
            _planned(stats, [plan.Matrix(s, fsdp_dim=i % 2) for i, s in enumerate(shapes)],
                     plan.Mesh(dp_replicate=grid.size(0), dp_shard=grid.size(1)), "split" if used == "split" else "owner",
                     64 if workspace == "auto" else workspace)
            finals[work] = [p.to_local().clone() for p in params]
        for work in ("split", "auto"):
            for a, b in zip(finals["repeat"], finals[work]):
                assert torch.equal(a, b), f"replica_work {work} and repeat differ"


def check_planner_on_2d_meshes():
    """The planner's counts on FSDP x TP (a matrix TP does not shard is a replica over TP for
    replica_work="split") and EP x TP (experts sharded over EP and TP: an owner orthogonalizes its EP
    slice only; gather mode gathers the experts' EP dim too)."""
    fsdp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "tp"))
    layout = [((16, 8), [Shard(0), Replicate()], None)] * 3 + [((12, 20), [Shard(0), Shard(1)], 1)]
    for work in ("repeat", "split"):
        gen = torch.Generator().manual_seed(6)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), fsdp_tp, pl))
                  for s, pl, _ in layout]
        stats, _ = _step(Muon(params, lr=0.02, replica_work=work), params, torch.Generator().manual_seed(7))
        _planned(stats, [plan.Matrix(s, tp_dim=td) for s, _, td in layout], plan.Mesh(dp_shard=2, tp=2),
                 "split" if work == "split" else "owner")
    ep_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    layout = [((4, 16, 12), [Shard(0), Shard(1)]), ((24, 16), [Replicate(), Shard(0)])]
    for mode in ("owner", "gather"):
        gen = torch.Generator().manual_seed(8)
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen), ep_tp, pl)) for s, pl in layout]
        opt = Muon(params, lr=0.02, nd_mode="batch", sharded_mode=mode, replica_work="repeat")
        stats, _ = _step(opt, params, torch.Generator().manual_seed(9))
        _planned(stats, [plan.Matrix((16, 12), tp_dim=0, experts=4), plan.Matrix((24, 16), tp_dim=0)],
                 plan.Mesh(ep=2, tp=2), mode)


@exits_without_teardown
def worker(rank, world_size, init_file):
    with gloo_world(rank, world_size, init_file):
        if world_size == 4:
            check_replica_work(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
            check_planner_on_2d_meshes()
            return
        mesh = init_device_mesh("cpu", (world_size,))
        for mode in ("owner", "gather"):
            check_sharded(mesh, mode)
        check_legacy_dist_muon()
