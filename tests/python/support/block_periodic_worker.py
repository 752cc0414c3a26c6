"""One gloo rank of the MuonBP tests (spawned by test_block_periodic.py): ``Muon(block_period=P)``
on DTensor matrices sharded over 2 ranks (rows, columns, an uneven split, an expert batch
sharded on its matrix dims, a replicated matrix)."""

from __future__ import annotations

import copy
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import Muon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

LAYOUT = [((24, 16), Shard(0)), ((16, 24), Shard(1)), ((13, 8), Shard(0)), ((4, 12, 8), Shard(1)), ((8, 8), Replicate())]
KW = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest", nd_mode="batch")


def _params(mesh, gen):
    full = [torch.randn(s, generator=gen) for s, _ in LAYOUT]
    return full, [torch.nn.Parameter(distribute_tensor(t, mesh, [pl])) for t, (_, pl) in zip(full, LAYOUT)]


def _grads(mesh, gen, steps):
    return [[distribute_tensor(torch.randn(s, generator=gen), mesh, [pl]) for s, pl in LAYOUT] for _ in range(steps)]


def _step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()


def check(mesh, seed):
    gen = torch.Generator().manual_seed(seed)
    full, params = _params(mesh, gen)
    grads = _grads(mesh, gen, 3)
    # P = 1: Muon
    a = [torch.nn.Parameter(p.detach().clone()) for p in params]
    b = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_a, opt_b = Muon(a, block_period=1, **KW), Muon(b, **KW)
    for g in grads:
        _step(opt_a, a, g)
        _step(opt_b, b, g)
    assert all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(a, b)), "block_period=1 differs from Muon"
    # P = 3: steps 1 and 2 are Muon on each rank's local shards (plain tensors), step 3 a full step
    bp = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_bp = Muon(bp, block_period=3, **KW)
    local = [torch.nn.Parameter(p.detach().to_local().clone()) for p in params]
    opt_local = Muon(local, **KW)
    for g in grads[:2]:
        _step(opt_bp, bp, g)
        _step(opt_local, local, [x.to_local() for x in g])
    for i, (x, y) in enumerate(zip(bp, local)):
        assert torch.equal(x.to_local(), y), f"block step: param {i} differs from Muon on the local shard"
    assert opt_bp.step_stats()["collectives"] == 0, opt_bp.step_stats()
    full_step = [torch.nn.Parameter(p.detach().clone()) for p in bp]
    opt_full = Muon(full_step, **KW)
    opt_full.load_state_dict(copy.deepcopy(opt_bp.state_dict()))  # a plain Muon ignores the phase key
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in bp]
    opt_resumed = Muon(resumed, block_period=3, **KW)
    opt_resumed.load_state_dict(copy.deepcopy(opt_bp.state_dict()))
    for opt, ps in ((opt_bp, bp), (opt_full, full_step), (opt_resumed, resumed)):
        _step(opt, ps, grads[2])
    for i, (x, y, z) in enumerate(zip(bp, full_step, resumed)):
        assert torch.equal(x.to_local(), y.to_local()), f"full step: param {i} differs from Muon"
        assert torch.equal(x.to_local(), z.to_local()), f"resumed: param {i} differs"
    # block_lr_scale: the block step's update scaled
    half = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_half = Muon(half, block_period=2, block_lr_scale=0.5, **dict(KW, weight_decay=0.0))
    one = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_one = Muon(one, block_period=2, **dict(KW, weight_decay=0.0))
    _step(opt_half, half, grads[0])
    _step(opt_one, one, grads[0])
    for i, (p0, h, o) in enumerate(zip(params, half, one)):
        d_half, d_one = (h - p0).to_local(), (o - p0).to_local()
        if isinstance(LAYOUT[i][1], Replicate):  # whole on every rank: a Muon step, whatever the scale
            assert torch.equal(d_half, d_one), f"block_lr_scale changed the replicated param {i}"
        else:  # (p - u) - p rounds at p's magnitude
            torch.testing.assert_close(d_half, d_one * 0.5, rtol=1e-4, atol=1e-6, msg=f"block_lr_scale param {i}")


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        check(init_device_mesh("cpu", (world_size,)), seed)
