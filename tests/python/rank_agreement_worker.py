"""One rank of the tests that every rank takes the same path (spawned by test_sharded_agreement.py).

- Uneven shards whose local sizes would cut the workspace into different chunks on each rank
  (rank 0: 5 rows, rank 1: 4 rows of a 9-row matrix, at a budget between the two) step as the
  unsharded optimizer: the chunks are cut from the largest shard, the same on every rank.
- A shard that breaks DTensor's chunking rule, seen by some ranks only, is refused on every rank
  with the same ValueError (before, the other ranks entered the step's collectives and hung), in
  owner and gather mode, at construction and at add_param_group; the optimizer is left usable.
- Ranks that build different plans (here: different workspace budgets) raise the same error at
  construction, instead of pairing mismatched collectives in the first step.
- clip_grad_norm_ over plain tensors mixed with DTensors, and over DTensors of two meshes, clips
  every gradient by the total norm (torch's clip cannot mix them in one call).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

import megatron_eopt as me  # noqa: E402
from megatron_eopt.optim import AdaptiveMuon, Muon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from sharded_worker import check  # noqa: E402
from reference import rel_err  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

EVERY_RANK = r"every rank raises this"


def _bytes_of(rows, cols, g_rows, g_cols):  # _plan.entry_step_bytes of one (rows, cols) shard
    side = min(g_rows, g_cols)
    return 4 * (rows * cols + 3 * g_rows * g_cols + 2 * side * side)


def uneven_chunks(mesh, seed):
    # 9 rows over 2 ranks: shards of 5 and 4 rows. Sized locally, a budget of just under two 5-row
    # shards would take one matrix per chunk on rank 0 and two on rank 1.
    budget = (2 * _bytes_of(5, 16, 9, 16) - 1) / 2**20
    assert 2 * _bytes_of(4, 16, 9, 16) <= budget * 2**20
    for cls, extra in ((Muon, {}), (AdaptiveMuon, dict(moment2_method="normuon"))):
        check(mesh, [((9, 16), [Shard(0)])] * 4, cls, dict(extra, workspace_mib=budget), seed,
              label="uneven shards, small budget")


def _off_rule(mesh, rank):
    """A (6, 4) DTensor Shard(0) whose shards are 2 and 4 rows: not DTensor's 3 + 3."""
    rows = 2 if rank == 0 else 4
    local = torch.randn(rows, 4)
    return torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((6, 4)),
                                                 stride=(4, 1)))


def refusals_agree(mesh, rank):
    good = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None))
    for mode in ("owner", "gather"):
        bad = _off_rule(mesh, rank)
        with pytest.raises(ValueError, match=f"chunking rule.*{EVERY_RANK}"):
            Muon([good, bad], lr=0.02, sharded_mode=mode)
        opt = Muon([good], lr=0.02, sharded_mode=mode)
        with pytest.raises(ValueError, match=f"chunking rule.*{EVERY_RANK}"):
            opt.add_param_group({"params": [bad]})
        assert len(opt.param_groups) == 1
        good.grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None)
        opt.step()  # still usable, on every rank: the collectives pair up


def plans_agree(mesh, rank):
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(9, 16), mesh, [Shard(0)], src_data_rank=None))
              for _ in range(4)]
    budget = 0.001 if rank == 0 else None  # rank 0 cuts chunks, rank 1 does not
    with pytest.raises(ValueError, match=f"different step plans.*{EVERY_RANK}"):
        Muon(params, lr=0.02, workspace_mib=budget)


def clip_mixed(world, grid, rank):
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(6, 4, generator=gen) for _ in range(3)]
    plain = torch.nn.Parameter(torch.zeros(6, 4))
    on_world = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 4), world, [Shard(0)], src_data_rank=None))
    on_grid = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 4), grid, [Shard(0), Replicate()],
                                                   src_data_rank=None))
    plain.grad = full[0].clone()
    on_world.grad = distribute_tensor(full[1], world, [Shard(0)], src_data_rank=None)
    on_grid.grad = distribute_tensor(full[2], grid, [Shard(0), Replicate()], src_data_rank=None)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in full]))
    got = me.clip_grad_norm_([plain, on_world, on_grid], 1.0, policy="global")
    assert rel_err(got, total) <= 1e-6
    coef = 1.0 / (total + 1e-6)
    for p, g in zip((plain, on_world, on_grid), full):
        clipped = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        assert rel_err(clipped, g * coef) <= 1e-6


@exits_without_teardown
def worker(rank, world, init_file, seed):
    with gloo_world(rank, world, init_file):
        torch.manual_seed(seed + rank)
        mesh = init_device_mesh("cpu", (world,))
        uneven_chunks(mesh, seed)
        refusals_agree(mesh, rank)
        plans_agree(mesh, rank)
        grid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
        clip_mixed(mesh, grid, rank)
        dist.barrier()
