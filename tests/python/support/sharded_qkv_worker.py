"""One rank of the QKV-split tests on DTensor shards (spawned by test_optim_sharded.py, gloo on CPU).

A fused QKV projection split per query group (Megatron's layout, the TensorParallel classes'
split_qkv) must step the same sharded as whole: every rank builds the same full tensors and
gradients, distributes them, steps the optimizer on the DTensors and compares with the same
optimizer stepping the full tensors on this rank. The shards' rows cut through query groups
(3 groups of 4 + 2 + 2 rows over 2 or 4 ranks), in owner and gather mode, with Shard(0) and
Shard(1); Muon scales each part inside the split orthogonalization, the adaptive variants after
their normalization, both of which the sharded path must keep.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelAdaptiveMuon, TensorParallelMuon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from reference import rel_err  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

TOL = 1e-6  # fp32, "highest": the sharded step must equal the whole one
SPLIT = [4, 2, 2]  # rows of q, k, v per query group
GROUPS = 3
STEPS = 2
OPTIMIZERS = [(TensorParallelMuon, {})] + [
    (TensorParallelAdaptiveMuon, dict(moment2_method=m)) for m in ("adamuon", "normuon", "namo")
]


def step_both(opt, ref_opt, params, ref, grads, mesh, placements):
    """Steps the sharded optimizer and the whole one on the same gradients."""
    for step_grads in grads:
        for p, r, g in zip(params, ref, step_grads):
            p.grad = distribute_tensor(g, mesh, placements, src_data_rank=None)
            r.grad = g.clone()
        opt.step()
        ref_opt.step()


def check(mesh, placements, cls, extra, seed, sharded_mode):
    rows = GROUPS * sum(SPLIT)
    shapes = [(rows, 20), (12, 20)]  # the fused projection and a plain matrix beside it
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, placements, src_data_rank=None)) for t in full]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    qkv = {id(params[0]), id(ref[0])}
    kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest", split_qkv=True,
                  is_qkv_fn=lambda p: id(p) in qkv, qkv_split_shapes=SPLIT, **extra)
    opt = cls(params, **kwargs)
    opt.sharded_mode = sharded_mode  # the TensorParallel constructors take Megatron's arguments only
    opt._rebuild_plan()
    ref_opt = cls(ref, **kwargs)
    step_both(opt, ref_opt, params, ref, grads, mesh, placements)
    where = f"{cls.__name__} {extra} {placements} {sharded_mode} on {mesh.size()} ranks"
    ran = {mode: n for mode, n in opt._sharded.matrices.items() if n}
    expected = {} if placements == [Replicate()] or mesh.size() == 1 else {sharded_mode: 2 * STEPS}
    assert ran == expected, f"{where}: matrices orthogonalized per mode {ran}, expected {expected}"
    for i, (p, r, t) in enumerate(zip(params, ref, full)):
        assert isinstance(p, DTensor)
        err = rel_err(p.full_tensor() - t, r.detach() - t)
        assert err <= TOL, f"{where} param {i}: rel err {err:.2e} of the update"
        for key, value in ref_opt.state[r].items():
            got = opt.state[p][key]
            got = got.full_tensor() if isinstance(got, DTensor) else got
            assert rel_err(got, value) <= TOL, f"{where} param {i} state {key}"


def check_columns(mesh, placements, moment2_method, seed, sharded_mode):
    """A fused projection stored (in, out) (a Conv1D's c_attn; matrix_layout="in_out"): the split
    runs along the stored columns, which Shard(1) cuts through query groups."""
    rows = GROUPS * sum(SPLIT)
    shapes = [(20, rows), (3, 20, 2 * rows)]  # the projection, and experts (E, in, out) split per expert
    gen = torch.Generator().manual_seed(seed + 1)
    full = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, placements, src_data_rank=None)) for t in full]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest", sharded_mode=sharded_mode,
                  scale_mode="shape_scaling")

    def build(ps):
        groups = [{"params": [ps[0]], "matrix_layout": "in_out", "split_shapes": SPLIT},
                  {"params": [ps[1]], "matrix_layout": "in_out", "split_shapes": [1, 1], "nd_mode": "batch"}]
        if moment2_method is None:
            return Muon(groups, **kwargs)
        return AdaptiveMuon(groups, moment2_method=moment2_method, **kwargs)

    opt, ref_opt = build(params), build(ref)
    step_both(opt, ref_opt, params, ref, grads, mesh, placements)
    where = f"in_out {moment2_method} {placements} {sharded_mode} on {mesh.size()} ranks"
    for i, (p, r, t) in enumerate(zip(params, ref, full)):
        err = rel_err(p.full_tensor() - t, r.detach() - t)
        assert err <= TOL, f"{where} param {i}: rel err {err:.2e} of the update"


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        mesh = init_device_mesh("cpu", (world_size,))
        for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
            for cls, extra in OPTIMIZERS:
                check(mesh, placements, cls, extra, seed, "owner")
        for cls, extra in OPTIMIZERS[:2]:
            check(mesh, [Shard(0)], cls, extra, seed, "gather")
        for placements in ([Shard(0)], [Shard(1)]):
            for method in (None, "normuon", "adamuon"):
                check_columns(mesh, placements, method, seed, "owner")
        check_columns(mesh, [Shard(1)], None, seed, "gather")
