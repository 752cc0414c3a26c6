"""One rank of test_clipping's DTensor case: the gradients sharded (Shard(0)) over a 2-rank CPU mesh,
clipped by megatron_eopt.clip_grad_norm_ under each policy; saves the norms and the full gradients."""

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import megatron_eopt as me
from dist_harness import init_from_argv
from worker_exit import exits_without_teardown

SHAPES = [(8, 6), (4, 10), (6,), (8, 3)]  # the first two are the Muon part


def full_grads(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 10.0 for s in SHAPES]


@exits_without_teardown
def main():
    rank, world, seed, out, _ = init_from_argv()
    mesh = init_device_mesh("cpu", (world,))
    saved = {}
    for policy in me.CLIP_POLICIES:
        params = []
        for grad in full_grads(seed):
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, [Shard(0)]))
            p.grad = distribute_tensor(grad, mesh, [Shard(0)])
            params.append(p)
        norms = me.clip_grad_norm_(params, 1.0, policy=policy, muon_params=params[:2], return_parts=True)
        saved[policy] = {"norms": [n.clone() for n in norms], "plain": [not hasattr(n, "full_tensor") for n in norms],
                         "grads": [p.grad.full_tensor() for p in params]}
    torch.save(saved, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
