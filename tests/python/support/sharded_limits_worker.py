"""One rank of the tests of the sharded path's options, refusals and counts (spawned by test_optim_sharded.py).

Options: every constructor option of Muon / AdaptiveMuon that changes the step (the Newton–Schulz
recipe, weight decay, Nesterov, scale modes, coefficients, the Gram iteration, workspace chunking)
and torch.optim.Muon's per-head split, on Shard(0) DTensors over the ranks (rows cutting through
heads), must step as the same optimizer on the full tensors.

A matrix sharded across ranks (a DTensor the sharded path orthogonalizes whole, on an owner) must
never be stepped on its local shard where the result needs the whole matrix: a weight-update hook
(whole-matrix norms), an ``orthogonalize`` override (it would receive the shard) and a
tensor-parallel layout are refused with a ValueError before anything changes; the same options on
replicated DTensors step. ``ns_inputs_below_eps`` counts a sharded matrix once, on its owner.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import AdaptiveMuon, HyperballHook, Muon, MuonHyperball, TensorParallelMuon  # noqa: E402
from megatron_eopt.torch_optim import Muon as TorchMuon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from reference import rel_err  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

SHAPES = [(8, 6), (10, 4)]
OPTION_SHAPES = [(24, 16), (16, 40), (24, 16)]
HEAD_SHAPES = [(24, 16), (12, 40), (24, 16)]  # rows divisible by 3 and 4 heads
OPTION_TOL = 1e-6  # fp32, "highest": sharded equals whole
KW = dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest")
OPTIONS = [
    (Muon, dict(row_equilibration=True)),
    (Muon, dict(frobenius_renorm=True)),
    (Muon, dict(ns_eps_mode="add", ns_norm_divisor=1.02)),
    (Muon, dict(weight_decay_method="cautious")),
    (Muon, dict(weight_decay_method="l2", nesterov=True)),
    (Muon, dict(scale_mode="unit_rms_norm", extra_scale_factor=0.5)),
    (Muon, dict(coefficient_type="polar_express", num_ns_steps=6)),
    (Muon, dict(use_syrk=True)),
    (Muon, dict(workspace_mib=0.001)),  # one matrix per chunk
    (AdaptiveMuon, dict(moment2_method="normuon", row_equilibration=True)),
    (TorchMuon, dict(split_heads=4)),  # heads of 6 and 3 rows, shards of 12 and 6 rows on 2 ranks
    (TorchMuon, dict(split_heads=3)),  # heads of 8 and 4 rows cut by those shards
]


class OwnOrthogonalize(Muon):
    """An Emerging-Optimizers-style override: orthogonalizes by itself (here: a plain SVD polar factor)."""

    def orthogonalize(self, p, grad, **kwargs):
        u, _, vh = torch.linalg.svd(grad, full_matrices=False)
        return u @ vh


def _params(mesh, placements, seed):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in SHAPES:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen), mesh, placements,
                                                 src_data_rank=None))
        p.grad = distribute_tensor(torch.randn(shape, generator=gen), mesh, placements, src_data_rank=None)
        params.append(p)
    return params


def _hyperball(params):
    """MuonHyperball on ``params`` rescaled to its radius (1) first, as it requires."""
    with torch.no_grad():
        for p in params:
            p.div_(p.norm())
    return MuonHyperball(params, lr=0.02, hyperball_radius=1.0)


def _untouched(params, opt, build, match):
    before = [p.detach().full_tensor().clone() for p in params]
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert all(torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, params)), match
    assert not opt.state, match  # no state created either


def check_refusals(mesh, seed):
    builds = {
        "weight_update_hook HyperballHook": lambda ps: Muon(ps, lr=0.02, weight_update_hook=HyperballHook(1.0)),
        "weight_update_hook HyperballHook takes": _hyperball,
        "overrides orthogonalize": lambda ps: OwnOrthogonalize(ps, lr=0.02),
    }
    for match, build in builds.items():
        sharded = _params(mesh, [Shard(0)], seed)
        _untouched(sharded, build(sharded), build, match)
        replicated = _params(mesh, [Replicate()], seed)  # whole on every rank: steps
        opt = build(replicated)
        before = [p.detach().full_tensor().clone() for p in replicated]
        opt.step()
        assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, replicated)), match
    # A tensor-parallel layout on top of a DTensor spanning ranks.
    group = dist.group.WORLD

    class Collection:
        tp = group

    sharded = _params(mesh, [Shard(0)], seed)
    for p in sharded:
        p.partition_dim = 0
    with pytest.raises(ValueError, match="tensor-parallel layout"):
        TensorParallelMuon(sharded, lr=0.02, pg_collection=Collection(), tp_mode="duplicated").step()


def check_options_match_unsharded(mesh, seed):
    gen = torch.Generator().manual_seed(seed)
    for cls, extra in OPTIONS:
        kwargs = dict(lr=0.02, **extra) if cls is TorchMuon else {**KW, **extra}
        shapes = HEAD_SHAPES if cls is TorchMuon else OPTION_SHAPES
        full = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
        grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for t in full]
        ref = [torch.nn.Parameter(t.clone()) for t in full]
        opt, ref_opt = cls(params, **kwargs), cls(ref, **kwargs)
        for step_grads in grads:
            for p, r, g in zip(params, ref, step_grads):
                p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
                r.grad = g.clone()
            opt.step()
            ref_opt.step()
        for k, (p, r, t) in enumerate(zip(params, ref, full)):
            err = rel_err(p.detach().full_tensor() - t, r.detach() - t)
            assert err <= OPTION_TOL, f"{cls.__name__} {extra} param {k}: {err:.2e} of the update"


def check_below_eps_count(mesh, seed, mode):
    """One matrix's gradient far below ns_eps, one normal: summed over the ranks, the owner-mode
    count is 1 (each matrix counted once, where its Newton–Schulz runs); in gather mode every rank
    runs it and counts it."""
    params = _params(mesh, [Shard(0)], seed)
    params[0].grad = params[0].grad * 1e-20  # norm ~1e-19, below the default ns_eps (1e-15)
    opt = Muon(params, lr=0.02, momentum=0.0, nesterov=False, sharded_mode=mode)
    opt.step()
    count = opt.ns_inputs_below_eps
    assert count is not None and count.dtype == torch.int64 and count.dim() == 0, mode
    total = count.clone()
    dist.all_reduce(total)
    expected = 1 if mode == "owner" else dist.get_world_size()
    assert int(total) == expected, (mode, int(count), int(total))


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        mesh = init_device_mesh("cpu", (world_size,))
        check_refusals(mesh, seed)
        check_options_match_unsharded(mesh, seed)
        for mode in ("owner", "gather"):
            check_below_eps_count(mesh, seed, mode)
