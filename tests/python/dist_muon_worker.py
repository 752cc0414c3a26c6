"""One rank of the DistMuon test: python dist_muon_worker.py RANK WORLD PORT SEED OUT.

Every rank starts from the same parameters, computes its own grads each step (seeded by rank
and step), runs DistMuon and saves the final parameters to OUT.
"""

import os
import sys
import warnings

import torch
import torch.distributed as dist

SHAPES = [(8, 4)] * 3 + [(4, 8)] * 2 + [(5, 5)] + [(16, 2, 3, 1)]
STEPS = 3


def initial_params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(seed, rank, step):
    g = torch.Generator().manual_seed(seed * 1000 + rank * 100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def main():
    rank, world, port, seed, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron_eopt.muon import DistMuon

    params = initial_params(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        opt = DistMuon(params, lr=0.05, momentum=0.9, weight_decay=0.1)
    for step in range(STEPS):
        for p, g in zip(params, grads(seed, rank, step)):
            p.grad = g
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 0.5  # a schedule: read at every step
    owned_state = sum(1 for p in params if "momentum_buffer" in opt.state[p])
    torch.save({"params": [p.detach() for p in params], "owned_state": owned_state}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
