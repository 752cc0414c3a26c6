"""One rank of the riding agreement's parity run (spawned by test_riding.py).

Started as ``riding_worker.py RANK WORLD PORT SEED OUT STATE_DTYPE[,nccl]`` (gloo on the CPU; with
``,nccl`` NCCL over one CUDA device per rank): two optimizers over the same
Shard(0) DTensor matrices on a 1-D mesh of every rank (awkward shapes: a row, a column, primes,
fewer rows than ranks), one with ``rank_checks="every_step"`` and one with ``"riding"``, take the
same steps: a learning rate scheduled every step, a gradient missing on every rank alike, the
workspace changed alike (more chunks), a step where rank 1 alone writes another learning rate and
one where a gradient is missing on rank 1 alone (both optimizers must raise the same error there,
leaving everything unchanged) and steps after them; then a copy of the riding optimizer. Saves per step
whether each raised (and what), whether parameters and state are bitwise equal between the two,
and both optimizers' ``step_stats()``.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import Muon  # noqa: E402
from dist_harness import RANK_CPU_PRODUCTS  # noqa: E402

SHAPES = [(1, 9), (9, 1), (13, 5), (5, 13), (2, 7), (16, 16), (16, 16)]
KW = dict(lr=0.02, momentum=0.9, weight_decay=0.01, fp32_matmul_prec="highest")


def _params(mesh, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen).to(mesh.device_type), mesh, [Shard(0)],
                                                 src_data_rank=None)) for s in SHAPES]


def _set_grads(param_sets, seed, missing=()):
    gen = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(s, generator=gen).to(param_sets[0][0].device) for s in SHAPES]
    for params in param_sets:
        for i, (p, full) in enumerate(zip(params, fulls)):
            p.grad = None if i in missing else distribute_tensor(full, p.device_mesh, p.placements,
                                                                  src_data_rank=None)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _equal(pa, oa, pb, ob) -> bool:
    for a, b in zip(pa, pb):
        if not torch.equal(_local(a.detach()), _local(b.detach())):
            return False
        sa, sb = oa.state.get(a, {}), ob.state.get(b, {})
        if sa.keys() != sb.keys():
            return False
        for k in sa:
            x, y = sa[k], sb[k]
            if isinstance(x, torch.Tensor) and not torch.equal(_local(x), _local(y)):
                return False
    return True


def main():
    rank, world, port, seed, out, case = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                          sys.argv[5], sys.argv[6])
    state_dtype, _, setup = case.partition(",")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    device_type = "cuda" if setup == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if setup == "nccl" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    import megatron_eopt

    megatron_eopt.set_cpu_symmetric_products(RANK_CPU_PRODUCTS["symmetric"])
    megatron_eopt.set_cpu_bf16_products(RANK_CPU_PRODUCTS["bf16"])
    mesh = init_device_mesh(device_type, (world,))
    pa, pb = _params(mesh, seed), _params(mesh, seed)
    every, riding = Muon(pa, **KW, state_dtype=state_dtype), Muon(pb, **KW, state_dtype=state_dtype)
    riding.rank_checks = "riding"
    records = []
    for step in range(9):
        missing = (3,) if step == 3 else (2,) if step == 7 and rank == 1 else ()  # 7: on rank 1 alone
        _set_grads((pa, pb), seed + 1 + step, missing)
        lr = 0.02 * 0.9**step
        for opt in (every, riding):
            opt.param_groups[0]["lr"] = lr if not (step == 5 and rank == 1) else lr / 2  # step 5: rank 1 differs
            if step == 4:
                opt.workspace_mib = 0.001  # alike on every rank: a few matrices per chunk
        errors = []
        for opt in (every, riding):
            try:
                opt.step()
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        records.append(dict(step=step, errors=errors, equal=_equal(pa, every, pb, riding),
                            stats=riding.step_stats(), every_stats=every.step_stats(),
                            ticket=riding._ride_ticket is not None))
        torch.save(records, out)
    copied = copy.deepcopy(riding)  # (the ticket holds a process group: a copy leaves it behind)
    records.append(dict(copied_ticket=copied._ride_ticket is not None,
                        kept_copies=sorted(str(d) for _, d in riding.__dict__.get("_ride_copies", {}))))
    torch.save(records, out)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
