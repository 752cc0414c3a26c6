"""One rank of the DTensor / FSDP2 optimizer tests (spawned by test_optim_sharded.py, gloo on CPU).

Every rank builds the same full parameters and gradients (one seed), distributes them with the
placements under test, steps the optimizer on the DTensors and compares with the unsharded
optimizer stepping the full tensors on this rank. Meshes: the world (4 ranks), a 2 x 2 mesh
(FSDP x TP, HSDP), a 1 x 2 x 2 mesh (HSDP x TP), its rows (2 ranks) and a 4 x 1 mesh whose second
dim is a 1-rank mesh; a world of 8 ranks holds a 2 x 2 x 2 mesh (HSDP x TP with two replicas, and
pipeline stages with a 2 x 2 FSDP x TP mesh each).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import AdaptiveMuon, Muon  # noqa: E402
from reference import rel_err  # noqa: E402
from dist_harness import counted_collectives, gloo_world  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

TOL = 1e-6  # fp32, precision "highest": the sharded step must equal the unsharded one
STEPS = 2
OPTIMIZERS = [(Muon, {})] + [(AdaptiveMuon, dict(moment2_method=m)) for m in ("adamuon", "normuon", "namo")]


def _kwargs(extra, **more):
    return dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest", nesterov=True, **extra,
                **more)


def _dist(t, mesh, placements, rows=None):
    """t laid out by placements (every rank holds the same full tensor). ``rows``: a 1-D mesh's
    Shard(0) cut into these rows per rank instead of DTensor's chunks (Megatron-FSDP's uneven shards)."""
    if rows is None:
        return distribute_tensor(t, mesh, placements, src_data_rank=None)
    start = sum(rows[: mesh.get_coordinate()[0]])
    local = t[start : start + rows[mesh.get_coordinate()[0]]].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def _rows_of(entry):
    return entry[2] if len(entry) > 2 else None


def check(mesh, layout, cls, extra, seed, nd_mode="error", sharded_mode="owner", expect=None, label="", ran=None):
    """layout: [(shape, placements)] or [(shape, placements, rows)] (uneven row shards, see _dist).
    Steps sharded and unsharded; compares params and state (an uneven param: its local rows, with
    no state check: DTensor's full_tensor assumes its own chunks).
    ran: the only mode ("owner" | "gather") that may have orthogonalized the sharded matrices."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(entry[0], generator=gen) * 0.1 for entry in layout]
    grads = [[torch.randn(entry[0], generator=gen) for entry in layout] for _ in range(STEPS)]
    params = [torch.nn.Parameter(_dist(t, mesh, entry[1], _rows_of(entry))) for t, entry in zip(full, layout)]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    kwargs = _kwargs(extra, nd_mode=nd_mode)
    opt = cls(params, sharded_mode=sharded_mode, **kwargs)
    ref_opt = cls(ref, **kwargs)
    with counted_collectives(_COUNTED) as calls:
        for step_grads in grads:
            for p, r, g, entry in zip(params, ref, step_grads, layout):
                p.grad = _dist(g, mesh, entry[1], _rows_of(entry))
                r.grad = g.clone()
            opt.step()
            ref_opt.step()
    got = {k: v for k, v in calls.items() if v}
    if expect is not None:
        assert got == expect, f"{label}: collectives {got}, expected {expect}"
    where = f"{label} {cls.__name__} {extra} {sharded_mode}"
    if ran is not None:
        modes = {mode: n for mode, n in opt._sharded.matrices.items() if n}
        assert list(modes) == [ran], f"{where}: matrices orthogonalized per mode {modes}, expected {ran} only"
    for i, (p, r, t, entry) in enumerate(zip(params, ref, full, layout)):
        shape, pl, rows = entry[0], entry[1], _rows_of(entry)
        assert isinstance(p, DTensor) and p.placements == tuple(pl), f"{where} param {i} lost its placements"
        if rows is not None:
            start = sum(rows[: mesh.get_coordinate()[0]])
            mine = slice(start, start + rows[mesh.get_coordinate()[0]])
            err = rel_err(p.to_local() - t[mine], r.detach()[mine] - t[mine])
            assert err <= TOL, f"{where} param {i} {shape} rows {rows}: rel err {err:.2e}"
            continue
        err = rel_err(p.full_tensor() - t, r.detach() - t)
        assert err <= TOL, f"{where} param {i} {shape} {pl}: rel err {err:.2e}"
        for key, value in ref_opt.state[r].items():
            got = opt.state[p][key]
            if not isinstance(value, torch.Tensor):  # e.g. state_block_size
                assert got == value, f"{where} param {i} {key}: {got} vs {value}"
                continue
            assert isinstance(got, DTensor) and got.device_mesh == mesh, f"{where} state {key} is not a DTensor"
            codes = value.dtype in LOW_MEMORY_DTYPES
            got, value = (full_bytes(got), value.view(torch.uint8)) if codes else (got.full_tensor(), value)
            assert got.shape == value.shape, f"{where} param {i} {key}: {tuple(got.shape)} vs {tuple(value.shape)}"
            if codes:  # drawn alike whatever the layout, so bitwise equal
                assert torch.equal(got, value), f"{where} param {i} state {key} (codes) differ"
            else:
                assert rel_err(got, value) <= TOL, f"{where} param {i} state {key}"
    return opt


# Low-memory state codes (fp32 params: a state in one of these dtypes is codes, not values).
LOW_MEMORY_DTYPES = (torch.bfloat16, torch.int8, torch.float8_e4m3fn)


def full_bytes(t: DTensor) -> torch.Tensor:
    """The full tensor of a state DTensor as bytes of its elements' bits (gloo has no float8 collectives)."""
    as_bytes = DTensor.from_local(t.to_local().contiguous().view(torch.uint8), t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape if t.element_size() == 1 else None,
                                  stride=t.stride() if t.element_size() == 1 else None)
    return as_bytes.full_tensor() if t.element_size() == 1 else t.full_tensor().view(torch.uint8)


_COUNTED = ("all_to_all_single", "all_gather_into_tensor", "all_reduce", "all_gather")


def check_placements(world, grid, cube, pair, single, seed):
    shapes = [(37, 24), (24, 37), (3, 8), (37, 24)]  # uneven rows, wide, fewer rows than ranks, a repeat
    for sharded_mode in ("owner", "gather"):
        # The statistics' reductions do not depend on the mode: gather runs Muon and NorMuon only.
        optimizers = OPTIMIZERS if sharded_mode == "owner" else OPTIMIZERS[::2]
        for cls, extra in optimizers:
            for placements in ([Shard(0)], [Shard(1)]):
                check(world, [(s, placements) for s in shapes], cls, extra, seed, sharded_mode=sharded_mode,
                      label=f"world {placements}", ran=sharded_mode)
            check(world, [(s, [Replicate()]) for s in shapes], cls, extra, seed, sharded_mode=sharded_mode,
                  label="world replicated")
            # 2-D meshes: FSDP x TP (rows and columns, rows twice: each rank's shard a box spanning
            # both mesh dims), HSDP (replicate x shard); owner mode must not fall back to gather
            for placements in ([Shard(0), Shard(1)], [Shard(0), Shard(0)], [Replicate(), Shard(0)],
                               [Shard(1), Replicate()]):
                check(grid, [(s, placements) for s in shapes], cls, extra, seed, sharded_mode=sharded_mode,
                      label=f"2x2 {placements}", ran=sharded_mode)
            # HSDP x TP on a 3-D mesh: the matrix spans 2 of its 3 dims, no mesh dim's group holds
            # those ranks, the all-to-alls run over the world
            check(cube, [(s, [Replicate(), Shard(0), Shard(1)]) for s in shapes], cls, extra, seed,
                  sharded_mode=sharded_mode, label="1x2x2 HSDP x TP", ran=sharded_mode)
        try:  # FSDP2 over tensor parallelism shards dim 0 twice with a strided dp shard: gather path
            from torch.distributed.tensor.placement_types import _StridedShard
        except ImportError:
            _StridedShard = None
        if _StridedShard is not None:
            for cls, extra in optimizers:
                check(grid, [(s, [_StridedShard(0, split_factor=2), Shard(0)]) for s in shapes[:2]], cls, extra,
                      seed, sharded_mode=sharded_mode, label="FSDP x TP strided", ran="gather")
        for placements in ([Shard(0)], [Shard(1)]):
            check(pair, [(s, placements) for s in shapes], Muon, {}, seed, sharded_mode=sharded_mode,
                  label=f"2 ranks {placements}")
            check(single, [(s, placements) for s in shapes], Muon, {}, seed, sharded_mode=sharded_mode,
                  label=f"1 rank {placements}")
    # Owner mode: per chunk of 2 x 4 matrices one all-to-all there and one back, and before each step
    # the ranks' agreement (one all-reduce per mesh dim); nothing else (Muon).
    shapes = [(37, 24)] * 9 + [(16, 16)]
    check(world, [(s, [Shard(0)]) for s in shapes], Muon, {}, seed,
          expect={"all_to_all_single": 2 * 2 * STEPS, "all_reduce": STEPS}, label="owner collectives")
    # The same over a 2 x 2 mesh (FSDP x TP): one all-to-all over the world each way per chunk.
    check(grid, [(s, [Shard(0), Shard(1)]) for s in shapes], Muon, {}, seed,
          expect={"all_to_all_single": 2 * 2 * STEPS, "all_reduce": 2 * STEPS}, label="2x2 owner collectives",
          ran="owner")


def check_transposed_grid(seed):
    """A 2 x 2 mesh whose ranks are laid out column-major: the owners' boxes come from the mesh's
    coordinates of each rank, not from rank arithmetic."""
    from torch.distributed.device_mesh import DeviceMesh

    grid = DeviceMesh("cpu", torch.arange(4).view(2, 2).T.contiguous(), mesh_dim_names=("x", "y"))
    shapes = [(37, 24), (24, 37), (3, 8)]
    for placements in ([Shard(0), Shard(1)], [Shard(1), Shard(0)]):
        for cls, extra in (OPTIMIZERS[0], OPTIMIZERS[2]):
            check(grid, [(s, placements) for s in shapes], cls, extra, seed, label=f"column-major 2x2 {placements}",
                  ran="owner")


def check_each_matrix_once(world, seed):
    """Owner mode orthogonalizes every matrix on exactly one rank, work balanced across ranks."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 24)] * 6 + [(16, 48)] * 2
    params = [torch.nn.Parameter(_dist(torch.randn(s, generator=gen), world, [Shard(0)])) for s in shapes]
    opt = Muon(params, lr=0.02)
    counted = []
    original = opt._sharded._ns

    def ns(full, config=None, splits=None):
        counted.extend(tuple(t.shape) for t in full)
        return original(full, config, splits)

    opt._sharded._ns = ns
    for p, s in zip(params, shapes):
        p.grad = _dist(torch.randn(s, generator=gen), world, [Shard(0)])
    opt.step()
    mine = torch.tensor([len(counted)])
    dist.all_reduce(mine)
    assert int(mine) == len(shapes), f"{int(mine)} Newton–Schulz runs for {len(shapes)} matrices"
    assert 1 <= len(counted) <= 3, f"unbalanced owners: this rank ran {counted}"


def check_moe(world, grid, seed):
    expert = (8, 12, 20)  # 8 experts of 12 x 20 on 4 ranks
    uneven = (6, 20, 12)  # 6 experts on 4 ranks: 2, 2, 2, 0
    for cls, extra in OPTIMIZERS:
        # Expert parallel: every rank orthogonalizes the experts it holds, no communication
        # (NAMO / NorMuon statistics are per expert, so nothing is reduced either).
        check(world, [(expert, [Shard(0)]), (uneven, [Shard(0)])], cls, extra, seed, nd_mode="batch",
              expect={}, label="experts dim 0")
        # Experts sharded inside the matrices go through the owner path.
        check(world, [(expert, [Shard(1)]), (uneven, [Shard(2)])], cls, extra, seed, nd_mode="batch",
              label="experts dim 1/2")
        check(grid, [(expert, [Shard(0), Shard(1)])], cls, extra, seed, nd_mode="batch", label="EP x TP")
        check(world, [((8, 3, 2, 2), [Shard(0)])], cls, extra, seed, nd_mode="flatten", label="conv flatten")


def check_bad_input(world, pair, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.nn.Parameter(_dist(torch.randn(8, 8, generator=gen), world, [Shard(0)]))
    b = torch.nn.Parameter(_dist(torch.randn(8, 8, generator=gen), pair, [Shard(0)]))
    before = a.full_tensor().clone()
    cases = [
        (lambda: Muon([a, b]), "mesh"),
        (lambda: Muon([torch.nn.Parameter(DTensor.from_local(torch.randn(8, 8), world, [Partial()]))]), "Partial"),
        (lambda: Muon([torch.nn.Parameter(_dist(torch.randn(4, 8, 8, generator=gen), world, [Shard(0)]))]),
         "nd_mode"),
        (lambda: Muon([a], sharded_mode="scatter"), "sharded_mode"),
        (lambda: Muon([a], nd_mode="stack"), "nd_mode"),
    ]
    for make, needle in cases:
        try:
            make()
        except ValueError as e:
            assert needle in str(e), f"error does not name {needle}: {e}"
        else:
            raise AssertionError(f"no error for a bad input ({needle})")
    opt = Muon([a], lr=0.1)
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(_dist(torch.randn(2, 4, 4), world, [Shard(0)]))]})
    except ValueError as e:
        assert "nd_mode" in str(e)
    else:
        raise AssertionError("3-D DTensor accepted without nd_mode")
    assert len(opt.param_groups) == 1 and not opt.state
    assert torch.equal(a.full_tensor(), before)


class _Net(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        # 37 rows: uneven (padded) FSDP2 shards on 2 and 4 ranks
        self.a = torch.nn.Linear(24, 37, bias=False)
        self.b = torch.nn.Linear(37, 37, bias=False)
        self.c = torch.nn.Linear(37, 24, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _fsdp(mesh, seed, reshard_after_forward=True):
    from torch.distributed.fsdp import fully_shard

    model = _Net(torch.Generator().manual_seed(seed))
    for layer in (model.a, model.b, model.c):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def check_fsdp(mesh, seed, reshard_after_forward, cls, extra):
    """A real FSDP2 model (forward, backward, reduce-scattered grads); each step compared with the
    unsharded optimizer stepping the full tensors with the same grads."""
    model = _fsdp(mesh, seed, reshard_after_forward)
    params = list(model.parameters())
    kwargs = _kwargs(extra)
    opt = cls(model.parameters(), **kwargs)
    ref = [torch.nn.Parameter(p.full_tensor()) for p in params]
    ref_opt = cls(ref, **kwargs)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    for step in range(STEPS):
        loss = model(torch.randn(5, 24, generator=gen)).square().mean()
        loss.backward()
        for p, r in zip(params, ref):
            r.grad = p.grad.full_tensor()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for i, (p, r) in enumerate(zip(params, ref)):
            err = rel_err(p.full_tensor(), r.detach())
            assert err <= TOL, f"FSDP2 {cls.__name__} {extra} reshard={reshard_after_forward} param {i}: {err:.2e}"
            r.data.copy_(p.full_tensor())  # next step starts from the same point


def _dcp_run(model, opt, grads_for, steps):
    for step in steps:
        for name, p in model.named_parameters():
            p.grad = _dist(grads_for(name, step), p.device_mesh, p.placements)
        opt.step()


def check_dcp(world, pair, seed, path, cls, extra):
    """Saved with DCP on 2 ranks after 2 steps, loaded on 4, 2 more steps == 4 unsharded steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    shapes = {n: tuple(p.shape) for n, p in _Net(torch.Generator()).named_parameters()}

    def grads_for(name, step):
        g = torch.Generator().manual_seed(seed + 7919 * step + sorted(shapes).index(name))
        return torch.randn(shapes[name], generator=g)

    kwargs = _kwargs(extra)
    if dist.get_rank() < 2:  # ranks 0, 1: the 2-rank run that writes the checkpoint
        model = _fsdp(pair, seed)
        opt = cls(model.parameters(), **kwargs)
        _dcp_run(model, opt, grads_for, range(2))
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=path, process_group=pair.get_group())
    dist.barrier()
    model = _fsdp(world, seed + 1)  # other initial values: everything must come from the checkpoint
    opt = cls(model.parameters(), **kwargs)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    _dcp_run(model, opt, grads_for, range(2, 4))

    ref_model = _Net(torch.Generator().manual_seed(seed))
    ref_opt = cls(ref_model.parameters(), **kwargs)
    for step in range(4):
        for name, p in ref_model.named_parameters():
            p.grad = grads_for(name, step)
        ref_opt.step()
    ref_params = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name]
        assert rel_err(p.full_tensor(), r.detach()) <= TOL, f"DCP 2 -> 4 ranks {cls.__name__} {extra}: {name}"
        for key, value in ref_opt.state[r].items():
            got = opt.state[p][key]
            assert isinstance(got, DTensor), f"DCP: state {key} of {name} is not a DTensor after loading"
            assert rel_err(got.full_tensor(), value) <= TOL, f"DCP {cls.__name__} {extra}: {name} state {key}"


def check_legacy_dist_muon(mesh, seed):
    """megatron_eopt.muon.DistMuon on FSDP2-layout DTensors equals the legacy Muon on the full tensors."""
    import warnings

    from megatron_eopt.muon import DistMuon
    from megatron_eopt.muon import Muon as LegacyMuon

    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 24), (24, 37), (37, 24), (8, 3, 2, 2)]
    full = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    params = [torch.nn.Parameter(_dist(t, mesh, [Shard(0)])) for t in full]
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = DistMuon(params, lr=0.05, momentum=0.9, weight_decay=0.1)
        ref_opt = LegacyMuon(ref, lr=0.05, momentum=0.9, weight_decay=0.1)
    for step in range(STEPS):
        for p, r, s in zip(params, ref, shapes):
            g = torch.randn(s, generator=gen)
            p.grad, r.grad = _dist(g, mesh, [Shard(0)]), g
        opt.step()
        ref_opt.step()
    for i, (p, r, t) in enumerate(zip(params, ref, full)):
        # bf16 Newton–Schulz (the legacy numbers): equal up to bf16 rounding of the batch composition
        err = rel_err(p.full_tensor() - t, r.detach() - t)
        assert err <= 2e-2, f"DistMuon on DTensors, param {i} {shapes[i]}: rel err {err:.2e}"
        assert isinstance(opt.state[p]["momentum_buffer"], DTensor)


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        world = init_device_mesh("cpu", (world_size,))
        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        pair = grid["tp"]
        single = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("a", "b"))["b"]
        cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        check_placements(world, grid, cube, pair, single, seed)
        check_transposed_grid(seed)
        check_each_matrix_once(world, seed)
        check_moe(world, grid, seed)
        check_bad_input(world, pair, seed)
        check_legacy_dist_muon(world, seed)
        for mesh in (world, pair):
            for reshard in (True, False):
                check_fsdp(mesh, seed, reshard, Muon, {})
        check_fsdp(world, seed, True, AdaptiveMuon, dict(moment2_method="normuon"))
        check_fsdp(pair, seed, False, AdaptiveMuon, dict(moment2_method="namo"))
        ckpt = os.path.join(os.path.dirname(init_file), "ckpt")
        for k, (cls, extra) in enumerate((OPTIMIZERS[0], OPTIMIZERS[2])):
            check_dcp(world, pair, seed, f"{ckpt}{k}", cls, extra)


@exits_without_teardown
def small_worker(rank, world_size, init_file, seed):
    """A world of 1 or 2 processes: FSDP2 on the whole world, Shard(0) / Shard(1) matrices and experts."""
    with gloo_world(rank, world_size, init_file):
        world = init_device_mesh("cpu", (world_size,))
        for reshard in (True, False):
            check_fsdp(world, seed, reshard, Muon, {})
        for cls, extra in (OPTIMIZERS[0], OPTIMIZERS[2]):
            for placements in ([Shard(0)], [Shard(1)]):
                check(world, [((37, 24), placements), ((24, 37), placements), ((4, 9, 6), placements)], cls, extra,
                      seed, nd_mode="batch", label=f"world of {world_size} {placements}")


def _replica_splits_only(replica: set[int]):
    """Wraps dist.all_to_all_single to check that no split reaches a rank outside `replica`."""
    original = dist.all_to_all_single

    def call(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        for name, splits in (("output", output_split_sizes), ("input", input_split_sizes)):
            crossing = [r for r, n in enumerate(splits or []) if n and r not in replica]
            assert not crossing, f"{name} splits {splits} move data between replicas (ranks {crossing})"
        return original(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    dist.all_to_all_single = call
    return original


@exits_without_teardown
def hsdp_tp_worker(rank, world_size, init_file, seed):
    """8 ranks, a 2 x 2 x 2 mesh (replicate, shard, tp): every matrix is split over the 4 ranks of
    its replica (2 mesh dims, no process group of their own). Owner mode with replica_work="repeat" runs over the world, each
    replica exchanging only among its own ranks, and equals the unsharded optimizer; with
    replica_work="split" the replicas share the owners. Then FSDP x TP x EP and a pipeline stage's mesh."""
    with gloo_world(rank, world_size, init_file):
        cube = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        replica = set(cube["shard", "tp"].mesh.flatten().tolist())
        shapes = [(37, 24), (24, 37), (3, 8), (37, 24)]
        original = _replica_splits_only(replica)
        try:
            for cls, extra in OPTIMIZERS:
                for placements in ([Replicate(), Shard(0), Shard(1)], [Replicate(), Shard(1), Shard(0)],
                                   [Replicate(), Shard(0), Shard(0)]):
                    check(cube, [(s, placements) for s in shapes], cls, dict(extra, replica_work="repeat"), seed,
                          label=f"2x2x2 {placements}", ran="owner")
            # per chunk of 2 x 4 matrices one all-to-all there and one back
            check(cube, [(s, [Replicate(), Shard(0), Shard(1)]) for s in [(37, 24)] * 9 + [(16, 16)]], Muon,
                  dict(replica_work="repeat"),
                  seed, expect={"all_to_all_single": 2 * 2 * STEPS, "all_reduce": 3 * STEPS},
                  label="2x2x2 owner collectives", ran="owner")
        finally:
            dist.all_to_all_single = original
        # replica_work="split": one owner in the whole mesh per matrix (the exchanges cross replicas)
        for cls, extra in OPTIMIZERS:
            check(cube, [(s, [Replicate(), Shard(0), Shard(1)]) for s in shapes], cls, dict(extra, replica_work="split"),
                  seed, label="2x2x2 split", ran="owner")
        check(cube, [(s, [Replicate(), Shard(0), Shard(1)]) for s in shapes], Muon, {}, seed, sharded_mode="gather",
              label="2x2x2 gather", ran="gather")
        check_fsdp_tp_ep(seed)
        check_stage_mesh(seed)


def check_fsdp_tp_ep(seed):
    """FSDP x TP x EP on a 2 x 2 x 2 mesh (dp, ep, tp): MoE experts (E, m, n) sharded on their expert
    dim over ep and on their matrix dims over dp and tp; dense weights sharded over dp and tp and
    replicated over ep, so with replica_work="split" the ep ranks share their Newton–Schulz."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    experts = [((4, 16, 12), [Shard(1), Shard(0), Shard(2)]), ((4, 12, 16), [Shard(2), Shard(0), Shard(1)])]
    dense = [((24, 16), [Shard(0), Replicate(), Shard(1)]), ((16, 24), [Shard(1), Replicate(), Shard(0)]),
             ((8, 8), [Replicate(), Replicate(), Replicate()])]
    for cls, extra in OPTIMIZERS:
        for work in ("repeat", "split"):
            check(mesh, experts + dense, cls, dict(extra, replica_work=work), seed, nd_mode="batch",
                  label=f"dp x ep x tp {work}", ran="owner")


def _no_world_collectives():
    """Wraps dist.all_to_all_single to check that it never runs over the world."""
    original = dist.all_to_all_single

    def call(*args, group=None, **kwargs):
        assert group is not None and group is not dist.group.WORLD, "an all-to-all over the world"
        return original(*args, group=group, **kwargs)

    dist.all_to_all_single = call
    return original


def check_stage_mesh(seed):
    """Pipeline parallel x FSDP x TP: a (pp, dp, tp) = 2 x 2 x 2 mesh whose params live on each
    stage's 2 x 2 (dp, tp) mesh, smaller than the world. No process group holds a matrix's 4
    ranks: the pieces hop over the dp and tp groups (two all-to-alls each way per chunk), and each
    stage runs only its own collectives."""
    root = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage = root["dp", "tp"]
    shapes = [(37, 24), (24, 37), (3, 8), (37, 24)]
    original = _no_world_collectives()
    try:
        for cls, extra in OPTIMIZERS:
            for placements in ([Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)]):
                check(stage, [(s, placements) for s in shapes], cls, extra, seed, label=f"stage 2x2 {placements}",
                      ran="owner")
        check(stage, [(s, [Shard(0), Shard(1)]) for s in [(37, 24)] * 9 + [(16, 16)]], Muon, {}, seed,
              expect={"all_to_all_single": 2 * 2 * 2 * STEPS, "all_reduce": 2 * STEPS},
              label="stage 2x2 owner collectives", ran="owner")
    finally:
        dist.all_to_all_single = original
