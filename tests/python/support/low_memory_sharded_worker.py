"""One rank of the sharded low-memory state test (spawned by test_low_memory_state_sharded.py, gloo on CPU).

FSDP2-style Shard(0) parameters with uneven rows keep int8 / fp8 / bf16 momentum as DTensors whose
block scales shard with the rows. Each step must equal the unsharded fp32 optimizer continuing from
the dequantized full state; DCP saves the state on 2 ranks and loads it on 4 bit for bit; a
parameter sharded along its rows (the last dimension) is refused at construction unless every shard
holds whole blocks. Sharded and chunked runs keep bitwise the unsharded run's state (rows, columns,
2-D meshes, experts, convolutions), since each element's stochastic rounding is keyed by the
parameter and its index in the whole parameter.
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
    # 12 columns over 4 ranks: shards of 3, not whole blocks of 256 (or of 2). Refused on every rank.
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 12), mesh, [Shard(1)], src_data_rank=None))
    for block in (256, 2):
        try:
            Muon([p], state_dtype="int8", state_block_size=block)
        except ValueError as e:
            assert "shards its rows" in str(e) and "every rank raises this" in str(e), str(e)
        else:
            raise AssertionError("a Shard(1) parameter whose shards cut blocks was accepted with int8 state")
    Muon([p], state_dtype="int8", state_block_size=3)  # each shard holds one whole block
    Muon([p], state_dtype="bf16")  # no scales: any sharding


# Layouts whose low-memory state must be bitwise that of the unsharded optimizer: FSDP2 rows (uneven),
# row-parallel columns (shards of whole blocks: 1024 columns over 4 ranks, blocks of 256), a 2-D mesh,
# MoE experts, and a convolution whose blocks run along its (size(0), -1) view.
LAYOUTS = [
    ((37, 300), "world", [Shard(0)]),
    ((12, 1024), "world", [Shard(1)]),
    ((9, 512), "grid", [Shard(0), Shard(1)]),
    ((3, 10, 512), "grid", [Shard(0), Shard(2)]),
    ((6, 4, 3, 3), "world", [Shard(0)]),
]


def _codes(state):
    """Every state tensor of one parameter as full bytes (codes, scales), for bitwise comparisons."""
    return {k: _bits(v) if isinstance(v, DTensor) else (str(v.dtype), v.contiguous().view(torch.uint8).clone())
            for k, v in state.items() if isinstance(v, torch.Tensor)}


def check_layout_independent(meshes, seed, fmt, cls, extra):
    """The sharded optimizer (owner mode, a budget of a matrix or two per chunk) and the unsharded one
    (one chunk) keep bitwise the same low-memory state: draws keyed by the parameter and each
    element's index in the whole parameter."""
    gen = torch.Generator().manual_seed(seed + 7)
    full = [torch.randn(shape, generator=gen) * 0.1 for shape, _, _ in LAYOUTS]
    params = [torch.nn.Parameter(distribute_tensor(t.clone(), meshes[m], pl, src_data_rank=None))
              for t, (_, m, pl) in zip(full, LAYOUTS)]
    whole = [torch.nn.Parameter(t.clone()) for t in full]
    kwargs = dict(KWARGS, **extra, state_dtype=fmt, nd_mode="flatten")
    # one param group per mesh (and nd mode)
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:4], "nd_mode": "batch"}, {"params": ps[4:]}]  # noqa: E731
    opt = cls(groups(params), **kwargs, workspace_mib=0.005)
    ref = cls(groups(whole), **kwargs, workspace_mib=None)
    for _ in range(3):
        for p, q, (shape, m, pl) in zip(params, whole, LAYOUTS):
            g = torch.randn(shape, generator=gen)
            p.grad = distribute_tensor(g, meshes[m], pl, src_data_rank=None)
            q.grad = g
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(params, whole)):
        assert rel_err(p.full_tensor(), q.detach()) <= 1e-6, f"{fmt} {cls.__name__} param {i}"
        got, want = _codes(opt.state[p]), _codes(ref.state[q])
        assert set(got) == set(want), (got.keys(), want.keys())
        for key in want:
            assert got[key][0] == want[key][0] and torch.equal(got[key][1], want[key][1]), \
                f"{fmt} {cls.__name__} param {i} {LAYOUTS[i][1:]}: {key} differs from the unsharded state"


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
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        for fmt in ("bf16", "int8", "fp8"):
            check_layout_independent({"world": world, "grid": grid}, seed, fmt, Muon, {})
        check_layout_independent({"world": world, "grid": grid}, seed, "fp8", AdaptiveMuon,
                                 dict(moment2_method="adamuon"))
        ckpt = os.path.join(os.path.dirname(init_file), "ckpt")
        for k, fmt in enumerate(("int8", "fp8")):
            check_dcp(world, pair, seed, f"{ckpt}{k}", fmt)
