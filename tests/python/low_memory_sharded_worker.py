"""One rank of the sharded low-memory state test (spawned by test_low_memory_state_sharded.py, gloo on CPU).

FSDP2-style Shard(0) parameters with uneven rows keep int8 / fp8 / bf16 momentum as DTensors whose
block scales shard with the rows. Each step must equal the unsharded fp32 optimizer continuing from
the dequantized full state; DCP saves the state on 2 ranks and loads it on 4 bit for bit; a
parameter sharded along its rows (the last dimension) is refused at construction.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt import low_memory_state as lms  # noqa: E402
from megatron_eopt.optim import AdaptiveMuon, Muon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from reference import rel_err  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

SHAPES = [(37, 300), (5, 24), (37, 37)]  # 37 and 5 rows: uneven shards on 2 and 4 ranks
KWARGS = dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest", nesterov=True)


def _full(t: DTensor) -> torch.Tensor:
    """t's full tensor; fp8 travels as bytes (gloo has no float8 collectives)."""
    if t.dtype != torch.float8_e4m3fn:
        return t.full_tensor()
    as_bytes = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return as_bytes.full_tensor().view(torch.float8_e4m3fn)


def _full_values(state, key):
    codes = _full(state[key])
    scales = state.get(key + "_scales")
    moment2_fp8 = key == "moment2_buffer" and codes.dtype == torch.float8_e4m3fn  # sqrt(v), linear codes
    out = lms.dequantize(codes, None if scales is None else scales.full_tensor(), state.get("state_block_size", 256),
                         linear_fp8=moment2_fp8)
    return out * out if moment2_fp8 else out


def check_steps(mesh, seed, fmt, cls, extra):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(s, generator=gen) * 0.1 for s in SHAPES]
    params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)], src_data_rank=None)) for t in full]
    ref_params = [torch.nn.Parameter(t.clone()) for t in full]
    opt = cls(params, **KWARGS, **extra, state_dtype=fmt)
    ref = cls(ref_params, **KWARGS, **extra)
    keys = ["momentum_buffer"] + (["moment2_buffer"] if extra.get("moment2_method") == "adamuon" else [])
    for step in range(3):
        grads = [torch.randn(s, generator=gen) for s in SHAPES]
        for p, q, g in zip(params, ref_params, grads):
            p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
            q.grad = g.clone()
        if step > 0:
            for p, q in zip(params, ref_params):
                for key in keys:
                    ref.state[q][key] = _full_values(opt.state[p], key)
        opt.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, ref_params)):
            assert rel_err(p.full_tensor(), q.detach()) <= 1e-6, f"{fmt} {cls.__name__} step {step} param {i}"
    for p in params:
        state = opt.state[p]
        assert isinstance(state["momentum_buffer"], DTensor) and state["momentum_buffer"].placements == (Shard(0),)
        if fmt != "bf16":
            scales = state["momentum_buffer_scales"]
            assert isinstance(scales, DTensor) and scales.placements == (Shard(0),)
            assert tuple(scales.shape) == lms.scales_shape(p.shape, 256)
            # the local scales are those of the local rows: blocks never straddle a shard
            assert scales.to_local().shape[0] == p.to_local().shape[0]


def check_row_sharding_is_refused(mesh):
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 12), mesh, [Shard(1)], src_data_rank=None))
    try:
        Muon([p], state_dtype="int8")
    except ValueError as e:
        assert "shards its rows" in str(e), str(e)
    else:
        raise AssertionError("a Shard(1) parameter with int8 state was accepted")
    Muon([p], state_dtype="bf16")  # no scales: any sharding


def _bits(v):
    """(dtype name, the full tensor's bytes) of a state DTensor; other values as they are (picklable
    for broadcast_object_list, which cannot carry float8 storages)."""
    if not isinstance(v, DTensor):
        return v
    full = _full(v)
    return str(full.dtype), full.contiguous().view(torch.uint8).clone()


def check_dcp(world, pair, seed, path, fmt):
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(seed + 1)
    full = [torch.randn(s, generator=gen) * 0.1 for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(3)]
    saved = None
    if dist.get_rank() < 2:
        params = [torch.nn.Parameter(distribute_tensor(t.clone(), pair, [Shard(0)], src_data_rank=None)) for t in full]
        opt = AdaptiveMuon(params, moment2_method="adamuon", **KWARGS, state_dtype=fmt)
        for gs in grads[:2]:
            for p, g in zip(params, gs):
                p.grad = distribute_tensor(g, pair, [Shard(0)], src_data_rank=None)
            opt.step()
        dcp.save({"optim": opt.state_dict()}, checkpoint_id=path, process_group=pair.get_group())
        saved = [{k: _bits(v) for k, v in opt.state[p].items()} for p in params]
        # Resuming on the same ranks continues bit for bit (the rounding seed travels with the state).
        twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        twin = AdaptiveMuon(twin_params, moment2_method="adamuon", **KWARGS, state_dtype=fmt)
        twin.init_state()
        state = {"optim": twin.state_dict()}
        dcp.load(state, checkpoint_id=path, process_group=pair.get_group())
        twin.load_state_dict(state["optim"])
        for o, ps in ((opt, params), (twin, twin_params)):
            for p, g in zip(ps, grads[2]):
                p.grad = distribute_tensor(g, pair, [Shard(0)], src_data_rank=None)
            o.step()
        for i, (p, q) in enumerate(zip(params, twin_params)):
            assert torch.equal(p.to_local(), q.to_local()), f"DCP {fmt}: resumed param {i} differs"
    dist.barrier()
    params = [torch.nn.Parameter(distribute_tensor(t.clone(), world, [Shard(0)], src_data_rank=None)) for t in full]
    opt = AdaptiveMuon(params, moment2_method="adamuon", **KWARGS, state_dtype=fmt)
    opt.init_state()
    state = {"optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    opt.load_state_dict(state["optim"])
    loaded = [{k: _bits(v) for k, v in opt.state[p].items()} for p in params]
    assert [int(s) for s in opt._state_seeds.values()] == [2], "the seed of the 2-rank run after 2 steps"
    objects = [saved]
    dist.broadcast_object_list(objects, src=0)
    for i, (want, got) in enumerate(zip(objects[0], loaded)):
        assert set(want) == set(got), (want.keys(), got.keys())
        for key, value in want.items():
            other = got[key]
            if isinstance(value, tuple):
                assert other[0] == value[0] and torch.equal(other[1], value[1]), f"DCP {fmt}: param {i} {key}"
                assert isinstance(opt.state[params[i]][key], DTensor)
            else:
                assert other == value
    for p, g in zip(params, grads[0]):
        p.grad = distribute_tensor(g, world, [Shard(0)], src_data_rank=None)
    opt.step()  # and the 4-rank optimizer steps on


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        world = init_device_mesh("cpu", (world_size,))
        pair = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))["b"]
        for fmt in ("bf16", "int8", "fp8"):
            check_steps(world, seed, fmt, Muon, {})
        check_steps(pair, seed, "int8", AdaptiveMuon, dict(moment2_method="adamuon"))
        check_row_sharding_is_refused(world)
        ckpt = os.path.join(os.path.dirname(init_file), "ckpt")
        for k, fmt in enumerate(("int8", "fp8")):
            check_dcp(world, pair, seed, f"{ckpt}{k}", fmt)
