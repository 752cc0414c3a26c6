"""One rank of the table of ranks that differ (spawned by test_rank_mismatch.py).

Started as ``rank_mismatch_worker.py RANK WORLD PORT SEED OUT CASES``: joins a gloo group whose
collectives time out after a few seconds (a hang fails fast instead of stalling the suite), runs each
case of the comma-separated CASES and saves, per case, the error this rank raised (type and
message; None if it raised nothing) and whether its parameters and optimizer state were left as
they were before the step or construction that raised (and, for a step, whether the optimizer held a
riding ticket before it). The test compares the ranks' records.

Every case builds on a 1-D mesh of all the ranks ("hsdp_*" cases: a 2-D mesh, replicas outermost)
a few Shard(0) DTensor matrices ("tensor_parallel_*": Megatron tensor-parallel shards over the world
group) and makes one rank differ from the others in one thing.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelMuon  # noqa: E402
from dist_harness import RANK_CPU_PRODUCTS  # noqa: E402

SHAPES = [(12, 8), (12, 8), (9, 20)]  # two of one shape: a swapped order is only told apart by name
COLLECTIVE_TIMEOUT_S = 20
# What the step-time cases set opt.rank_checks to ("riding:CASE" runs CASE with "riding").
RANK_CHECKS = {"mode": "every_step"}


def _mesh(case: str, world: int):
    if case.startswith("hsdp"):
        return init_device_mesh("cpu", (world // 3, 3) if world % 3 == 0 else (world // 2, 2),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def _placements(mesh):
    return [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]


def _params(mesh, seed, shapes=SHAPES, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen).to(dtype), mesh, _placements(mesh),
                                                 src_data_rank=None)) for s in shapes]


def _grads(params, seed, dtype=None):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        full = torch.randn(p.shape, generator=gen).to(dtype or p.dtype)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _snapshot(params, opt):
    state = {} if opt is None else copy.deepcopy({i: {k: v.to_local().clone() if isinstance(v, DTensor) else v
                                                      for k, v in opt.state[p].items()}
                                                  for i, p in enumerate(params)})
    return [(p.detach().to_local() if isinstance(p, DTensor) else p.detach()).clone() for p in params], state


def _same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    if any(not torch.equal(x, y) for x, y in zip(pa, pb)) or sa.keys() != sb.keys():
        return False
    for i in sa:
        if sa[i].keys() != sb[i].keys():
            return False
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            if isinstance(x, torch.Tensor) and not torch.equal(x, y):
                return False
    return True


# ---------------------------------------------------------------- the cases
# Each returns (the snapshot before the call that must raise, a callable making that call, a
# callable snapshotting after it). Construction cases have no optimizer state before.

KW = dict(lr=0.02, momentum=0.9, weight_decay=0.01, fp32_matmul_prec="highest")


def _at_construction(params, make):
    before = _snapshot(params, None)
    return before, make, lambda: _snapshot(params, None)


def _at_second_step(opt, params, seed, between=lambda: None, grads=None):
    opt.rank_checks = RANK_CHECKS["mode"]
    _grads(params, seed)
    opt.step()  # (agreed by an all-reduce; with "riding" the second step rides its first exchange)
    RANK_CHECKS["ticket"] = getattr(opt, "_ride_ticket", None) is not None
    (grads or (lambda: _grads(params, seed + 1)))()
    between()
    before = _snapshot(params, opt)
    return before, opt.step, lambda: _snapshot(params, opt)


def extra_param(mesh, rank, seed):
    params = _params(mesh, seed, SHAPES + ([(6, 4)] if rank == 1 else []))
    return _at_construction(params, lambda: Muon(params, **KW))


def extra_group(mesh, rank, seed):
    params = _params(mesh, seed)
    groups = [{"params": params[:2]}] + ([{"params": params[2:]}] if rank == 1 else [])
    return _at_construction(params, lambda: Muon(groups, **KW))


def option(name, value, cls=Muon, base=None):
    def case(mesh, rank, seed):
        params = _params(mesh, seed)
        kw = dict(KW, **(base or {}))
        if rank == 0:
            kw[name] = value
        return _at_construction(params, lambda: cls(params, **kw))

    case.__name__ = name
    return case


def bf16_params(mesh, rank, seed):
    params = _params(mesh, seed, dtype=torch.bfloat16 if rank == 2 else torch.float32)
    return _at_construction(params, lambda: Muon(params, **KW))


def swapped_named(mesh, rank, seed):
    params = _params(mesh, seed)
    names = ["q", "k", "o"]
    named = list(zip(names, params))
    if rank == 1:
        named[0], named[1] = named[1], named[0]
    return _at_construction(params, lambda: Muon(named, **KW))


def grad_missing(mesh, rank, seed, **extra):
    params = _params(mesh, seed)
    opt = Muon(params, **KW, **extra)

    def grads():
        _grads(params, seed + 1)
        if rank == 2:
            params[1].grad = None

    return _at_second_step(opt, params, seed, grads=grads)


def grad_missing_overlap(mesh, rank, seed):
    params = _params(mesh, seed)
    opt = Muon(params, **KW, overlap_backward=True)

    def backward():  # a model whose second matrix is unused on rank 2 this step
        loss = sum(p.to_local().pow(2).sum() for p in params if not (rank == 2 and p is params[1]))
        loss.backward()

    _grads(params, seed)
    opt.step()
    opt.zero_grad()
    before = _snapshot(params, opt)

    def step():
        backward()
        opt.step()

    return before, step, lambda: _snapshot(params, opt)


def refused_on_one_rank(mesh, rank, seed):
    params = _params(mesh, seed)
    opt = Muon(params, **KW)

    def between():  # a value only this rank refuses (the others would enter the step's collectives)
        if rank == 0:
            opt.param_groups[0]["weight_decay"] = float("nan")

    return _at_second_step(opt, params, seed, between)


def lr_scheduled_on_one_rank(mesh, rank, seed):
    params = _params(mesh, seed)
    opt = Muon(params, **KW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def between():
        if rank == 1:
            sched.step()

    return _at_second_step(opt, params, seed, between)


def lr_tensor(mesh, rank, seed):
    params = _params(mesh, seed)
    opt = Muon(params, **dict(KW, lr=torch.tensor(0.02)))

    def between():
        if rank == 0:
            opt.param_groups[0]["lr"].fill_(0.01)

    return _at_second_step(opt, params, seed, between)


def option_written(name, value, rank_writing=2):
    """An attribute written on one rank between steps (one that changes the first exchange's shape,
    or whether the step can ride, as much as one that does not)."""
    def case(mesh, rank, seed):
        params = _params(mesh, seed)
        opt = Muon(params, **KW)

        def between():
            if rank == rank_writing:
                setattr(opt, name, value)

        return _at_second_step(opt, params, seed, between)

    case.__name__ = f"{name}_written"
    return case


def loaded_other_checkpoint(mesh, rank, seed):
    params = _params(mesh, seed)
    opt = Muon(params, **KW)

    def between():
        if rank == 1:
            sd = opt.state_dict()
            sd["param_groups"][0]["momentum"] = 0.5
            opt.load_state_dict(sd)

    return _at_second_step(opt, params, seed, between)


def params_replaced_on_one_rank(mesh, rank, seed):
    """A parameter replaced in its group on rank 1 (that rank's plan is rebuilt at the step)."""
    params = _params(mesh, seed)
    opt = Muon(params, **KW)

    def between():
        if rank == 1:
            fresh = torch.nn.Parameter(params[2].detach().clone())
            fresh.grad = params[2].grad
            opt.param_groups[0]["params"][2] = fresh

    return _at_second_step(opt, params, seed, between)


def alike(mesh, rank, seed):
    """The control: ranks alike step without error (a check that raised here would be no check)."""
    params = _params(mesh, seed)
    opt = AdaptiveMuon(params, **KW, moment2_method="normuon")
    opt.rank_checks = RANK_CHECKS["mode"]
    _grads(params, seed)
    opt.step()
    RANK_CHECKS["ticket"] = getattr(opt, "_ride_ticket", None) is not None
    _grads(params, seed + 1)
    before = _snapshot(params, opt)
    return before, opt.step, lambda: before


def _tp_params(rank, world, seed):
    """Megatron tensor-parallel shards over the world (rows of a (12, 8) and columns of a (9, 21))."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dim in (((12, 8), 0), ((9, 21), 1)):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).chunk(world, dim=dim)[rank].clone())
        p.partition_dim, p.is_qkv, p.expert_tp = dim, False, False
        out.append(p)
    return out


def tensor_parallel_option(mesh, rank, seed):
    world = dist.get_world_size()
    params = _tp_params(rank, world, seed)
    pg = SimpleNamespace(tp=dist.group.WORLD, expt_tp=dist.group.WORLD)
    kw = dict(KW, pg_collection=pg, tp_mode="duplicated", num_ns_steps=6 if rank == 1 else 5)
    return _at_construction(params, lambda: TensorParallelMuon(params, **kw))


def tensor_parallel_grad_missing(mesh, rank, seed):
    world = dist.get_world_size()
    params = _tp_params(rank, world, seed)
    pg = SimpleNamespace(tp=dist.group.WORLD, expt_tp=dist.group.WORLD)
    opt = TensorParallelMuon(params, **KW, pg_collection=pg, tp_mode="distributed")
    opt.rank_checks = RANK_CHECKS["mode"]

    def grads(step):
        gen = torch.Generator().manual_seed(seed + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        if step and rank == 0:
            params[0].grad = None

    grads(0)
    opt.step()
    grads(1)
    before = _snapshot(params, opt)
    return before, opt.step, lambda: _snapshot(params, opt)


CASES = {
    "extra_param": extra_param,
    "extra_group": extra_group,
    "block_period": option("block_period", 2),
    "moment2_method": option("moment2_method", "adamuon", AdaptiveMuon, dict(moment2_method="normuon")),
    "replica_work": option("replica_work", "split"),
    "overlap_backward": option("overlap_backward", True),
    "num_ns_steps": option("num_ns_steps", 6),
    "precision": option("fp32_matmul_prec", "medium"),
    "coefficient_type": option("coefficient_type", "polar_express"),
    "bf16_params": bf16_params,
    "swapped_named": swapped_named,
    "grad_missing": grad_missing,
    "grad_missing_overlap": grad_missing_overlap,
    "refused_on_one_rank": refused_on_one_rank,
    "lr_scheduled_on_one_rank": lr_scheduled_on_one_rank,
    "lr_tensor": lr_tensor,
    "nesterov_written": option_written("nesterov", True),
    "extra_scale_factor_written": option_written("extra_scale_factor", 0.5),
    "loaded_other_checkpoint": loaded_other_checkpoint,
    "alike": alike,
    "tensor_parallel_option": tensor_parallel_option,
    "tensor_parallel_grad_missing": tensor_parallel_grad_missing,
    "workspace_mib_on_one_rank": option_written("workspace_mib", 0.0005, rank_writing=0),
    "sharded_mode_on_one_rank": option_written("sharded_mode", "gather", rank_writing=1),
    "rank_checks_on_one_rank": option_written("rank_checks", "construction"),
    "params_replaced_on_one_rank": params_replaced_on_one_rank,
    "hsdp_replica_work": option("replica_work", "repeat"),
    "hsdp_grad_missing": grad_missing,
    "hsdp_alike": alike,
}


def run_case(name, rank, world, seed):
    mode, _, case = name.rpartition(":")
    RANK_CHECKS["mode"] = mode or "every_step"
    mesh = _mesh(case, world)
    before, call, after = CASES[case](mesh, rank, seed)
    record = {"error": None, "unchanged": None, "ticket": RANK_CHECKS.pop("ticket", None)}
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to compare between ranks
        record["error"] = (type(exc).__name__, str(exc))
        record["traceback"] = traceback.format_exc()[-3000:]
    record["unchanged"] = _same(before, after())
    return record


def main():
    rank, world, port, seed, out, cases = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                           sys.argv[5], sys.argv[6])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.set_num_threads(1)
    import megatron_eopt

    megatron_eopt.set_cpu_symmetric_products(RANK_CPU_PRODUCTS["symmetric"])
    megatron_eopt.set_cpu_bf16_products(RANK_CPU_PRODUCTS["bf16"])
    records = {}
    for name in cases.split(","):
        records[name] = run_case(name, rank, world, seed)
        torch.save(records, out)  # after each case: what a later hang or abort cuts off still reports
        if records[name]["error"] is not None and "timed out" in records[name]["error"][1].lower():
            break  # the group is unusable after a collective timed out
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
