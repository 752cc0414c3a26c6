"""One rank of the agreement's placement check (spawned by test_agreement_host.py).

Started as ``agreement_device_worker.py RANK WORLD PORT SEED OUT SETUP`` with SETUP ``cpu`` (gloo, a
CPU mesh), ``nccl`` or ``gloo+nccl`` (``init_process_group("cpu:gloo,cuda:nccl")``; both with a CUDA
mesh, one device per rank). Steps ``Muon`` over two Shard(0) matrices twice, the second time with
rank 1's learning rate written alone, and saves where every agreement reduced its integers, the
error each step raised and whether the parameters and momentum were left as they were.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from megatron_eopt.optim import Muon
from megatron_eopt.optim.multirank import agreement

BACKENDS = {"cpu": "gloo", "nccl": "nccl", "gloo+nccl": "cpu:gloo,cuda:nccl"}


def _record_agreements(places: list) -> None:
    """Every all-reduce of the agreement's five integers appends its tensor's device type."""
    reduce = agreement.collectives.all_reduce

    def recording(tensor, *args, **kwargs):
        if tensor.dtype == torch.int64 and tensor.numel() == 5:
            places.append(tensor.device.type)
        return reduce(tensor, *args, **kwargs)

    agreement.collectives.all_reduce = recording


def main():
    rank, world, port, seed, out, setup = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                           sys.argv[5], sys.argv[6])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    device_type = "cpu" if setup == "cpu" else "cuda"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(BACKENDS[setup], rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    mesh = init_device_mesh(device_type, (world,))
    gen = torch.Generator().manual_seed(seed)

    def dtensor(shape):
        return distribute_tensor(torch.randn(shape, generator=gen).to(device_type), mesh, [Shard(0)],
                                 src_data_rank=None)

    params = [torch.nn.Parameter(dtensor(s)) for s in [(16, 8), (9, 20)]]
    opt = Muon(params, lr=0.02, fp32_matmul_prec="highest")
    places: list = []
    _record_agreements(places)
    record = {"errors": [], "places": places}
    for step in range(2):
        for p in params:
            p.grad = dtensor(p.shape)
        if step == 1 and rank == 1:
            opt.param_groups[0]["lr"] = 0.01
        before = [t.to_local().clone() for p in params for t in (p, opt.state[p].get("momentum_buffer", p))]
        try:
            opt.step()
            record["errors"].append(None)
        except ValueError as exc:
            record["errors"].append(str(exc))
            record["traceback"] = traceback.format_exc()[-3000:]
            after = [t.to_local() for p in params for t in (p, opt.state[p]["momentum_buffer"])]
            record["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after))
    torch.save(record, out)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
