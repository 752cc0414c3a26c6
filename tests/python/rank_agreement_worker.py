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
- NorMuon / NAMO statistics of a 4-D nd_mode="batch" parameter sharded on dim 0 are sharded with it,
  hold the unsharded values, and resume from a DCP checkpoint bit for bit.
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


def dcp_resume_of_batched_statistics(mesh, seed, path):
    # A 4-D nd_mode="batch" parameter sharded on dim 0 (3 over 2 ranks: 2 + 1): its NorMuon / NAMO
    # statistics are sharded with it, hold the unsharded values, and a DCP save -> load resumes as
    # the uninterrupted run, bit for bit.
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(seed)
    shape = (3, 2, 8, 6)
    full = torch.randn(shape, generator=gen) * 0.1
    grads = [torch.randn(shape, generator=gen) for _ in range(3)]
    for method in ("normuon", "namo"):
        kw = dict(lr=0.02, momentum=0.9, weight_decay=0.1, moment2_method=method, nd_mode="batch",
                  fp32_matmul_prec="highest")

        def make(p):
            return AdaptiveMuon([p], **kw)

        p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)], src_data_rank=None))
        opt = make(p)
        whole = torch.nn.Parameter(full.clone())
        ref = make(whole)
        for g in grads[:2]:
            p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
            whole.grad = g.clone()
            opt.step()
            ref.step()
        v = opt.state[p]["moment2_buffer"]
        assert v.placements == (Shard(0),) and tuple(v.shape) == tuple(ref.state[whole]["moment2_buffer"].shape)
        assert rel_err(v.full_tensor(), ref.state[whole]["moment2_buffer"]) <= 1e-6, method
        where = f"{path}-{method}"
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=where)
        q = torch.nn.Parameter(distribute_tensor(p.detach().full_tensor(), mesh, [Shard(0)], src_data_rank=None))
        resumed = make(q)
        resumed.init_state()
        state = {"optim": resumed.state_dict()}
        dcp.load(state, checkpoint_id=where)
        resumed.load_state_dict(state["optim"])
        for o, t in ((opt, p), (resumed, q)):
            t.grad = distribute_tensor(grads[2], mesh, [Shard(0)], src_data_rank=None)
            o.step()
        assert torch.equal(p.to_local(), q.to_local()), f"{method}: the resumed run differs"


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
        dcp_resume_of_batched_statistics(mesh, seed, os.path.join(os.path.dirname(init_file), "ckpt"))
        dist.barrier()
