"""One rank of the tests that every rank takes the same path (spawned by test_sharded_agreement.py).

- Uneven shards whose local sizes would cut the workspace into different chunks on each rank
  (rank 0: 5 rows, rank 1: 4 rows of a 9-row matrix, at a budget between the two) step as the
  unsharded optimizer: the chunks are cut from the largest shard, the same on every rank.
- A shard that breaks DTensor's chunking rule is refused on every rank with the same ValueError in
  gather mode (before, the other ranks entered the step's collectives and hung), at construction and
  at add_param_group; the optimizer is left usable. Owner mode takes such shards: Megatron-FSDP's
  uneven row shards (an empty one included) step as the unsharded optimizer, and resume from a
  state_dict.
- Ranks that build different plans (here: different workspace budgets) raise the same error at
  construction, instead of pairing mismatched collectives in the first step.
- clip_grad_norm_ over plain tensors mixed with DTensors, and over DTensors of two meshes, clips
  every gradient by the total norm (torch's clip cannot mix them in one call).
- NorMuon / NAMO statistics of a 4-D nd_mode="batch" parameter sharded on dim 0 are sharded with it,
  hold the unsharded values, and resume from a DCP checkpoint bit for bit.
"""

from __future__ import annotations

import copy
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
    """Shards off DTensor's chunking rule: owner mode takes them (their sizes are gathered from the
    ranks, as Megatron-FSDP lays them out: uneven_worker), gather mode refuses them on every rank."""
    good = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None))
    Muon([good, _off_rule(mesh, rank)], lr=0.02, sharded_mode="owner")
    for mode in ("gather",):
        bad = _off_rule(mesh, rank)
        with pytest.raises(ValueError, match=f"chunking rule.*{EVERY_RANK}"):
            Muon([good, bad], lr=0.02, sharded_mode=mode)
        opt = Muon([good], lr=0.02, sharded_mode=mode)
        with pytest.raises(ValueError, match=f"chunking rule.*{EVERY_RANK}"):
            opt.add_param_group({"params": [bad]})
        assert len(opt.param_groups) == 1
        good.grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)], src_data_rank=None)
        opt.step()  # still usable, on every rank: the collectives pair up


# (shape, rows on each of 2 ranks): Megatron-FSDP cuts its flat buffers where it likes, in whole rows
UNEVEN = [((6, 4), (2, 4)), ((9, 16), (9, 0)), ((5, 12), (1, 4)), ((8, 8), (4, 4))]


def _uneven(t: torch.Tensor, rows, mesh, rank):
    start = sum(rows[:rank])
    local = t[start : start + rows[rank]].clone()
    d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())
    try:  # Megatron-FSDP's own chunk metadata, where megatron-core bundles it
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import update_uneven_dtensor_chunk_metadata
    except ImportError:
        return d
    update_uneven_dtensor_chunk_metadata(d)
    return d


def megatron_fsdp_layouts(mesh, rank, seed):
    """Megatron-FSDP's uneven row shards (owner mode) equal the unsharded optimizer, Muon and AdaMuon,
    two steps, and a state_dict saved after the first step resumes to the same second step."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape, generator=gen) * 0.1 for shape, _ in UNEVEN]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in UNEVEN] for _ in range(2)]
    for cls, extra in ((Muon, {}), (AdaptiveMuon, dict(moment2_method="adamuon"))):
        kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest", **extra)
        params = [torch.nn.Parameter(_uneven(t, rows, mesh, rank)) for t, (_, rows) in zip(full, UNEVEN)]
        ref = [torch.nn.Parameter(t.clone()) for t in full]
        opt, ref_opt = cls(params, **kwargs), cls(ref, **kwargs)
        saved = None
        for step, step_grads in enumerate(grads):
            for p, r, g, (_, rows) in zip(params, ref, step_grads, UNEVEN):
                p.grad = _uneven(g, rows, mesh, rank)
                r.grad = g.clone()
            if step == 1:
                saved = ([p.detach().to_local().clone() for p in params], copy.deepcopy(opt.state_dict()))
            opt.step()
            ref_opt.step()
        for i, (p, r, t, (_, rows)) in enumerate(zip(params, ref, full, UNEVEN)):
            start = sum(rows[:rank])
            want = r.detach()[start : start + rows[rank]]
            got = p.detach().to_local()
            assert rel_err(got - t[start : start + rows[rank]], want - t[start : start + rows[rank]]) <= 1e-5, \
                f"{cls.__name__} uneven param {i} {rows}"
        # resume: a new optimizer on the first step's parameters and state takes the same second step
        again = [torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape,
                                                       stride=t.stride())) for local, t in zip(saved[0], full)]
        resumed = cls(again, **kwargs)
        resumed.load_state_dict(saved[1])
        for p, g, (_, rows) in zip(again, grads[1], UNEVEN):
            p.grad = _uneven(g, rows, mesh, rank)
        resumed.step()
        for a, b in zip(again, params):
            assert torch.equal(a.detach().to_local(), b.detach().to_local()), f"{cls.__name__}: resume differs"
    bad = [torch.nn.Parameter(_uneven(full[0], UNEVEN[0][1], mesh, rank))]
    with pytest.raises(ValueError, match=f"normuon.*{EVERY_RANK}"):
        AdaptiveMuon(bad, lr=0.02, momentum=0.9, weight_decay=0.0, moment2_method="normuon")
    with pytest.raises(ValueError, match=f"state_dtype.*{EVERY_RANK}"):
        Muon(bad, lr=0.02, state_dtype="bf16")


def plans_agree(mesh, rank):
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(9, 16), mesh, [Shard(0)], src_data_rank=None))
              for _ in range(4)]
    budget = 0.001 if rank == 0 else None  # rank 0 cuts chunks, rank 1 does not
    with pytest.raises(ValueError, match=rf"differ in workspace_mib: 0.001 on rank\(s\) \[0\]; None on rank\(s\) \[1\].*"
                                         f"{EVERY_RANK}"):
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
        megatron_fsdp_layouts(mesh, rank, seed)
        plans_agree(mesh, rank)
        grid = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
        clip_mixed(mesh, grid, rank)
        dcp_resume_of_batched_statistics(mesh, seed, os.path.join(os.path.dirname(init_file), "ckpt"))
        dist.barrier()
