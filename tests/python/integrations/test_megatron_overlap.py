"""``install(overlap_backward=True)``: Newton–Schulz starts as Megatron DDP's bucket groups finish
reducing, bitwise the step without overlap (megatron_overlap_worker.py, gloo ranks on the CPU)."""

import os

import pytest
import torch

import megatron_cpu  # noqa: E402

mcore_optimizer = megatron_cpu.megatron_optimizer_module()

pytestmark = pytest.mark.skipif(mcore_optimizer is None, reason="megatron-core is not installed")


@pytest.mark.distributed
@pytest.mark.parametrize("cases", [("chained_fp32", "chained_bf16", "experts_bf16", "bf16_grads_fp32_fc1"),
                                   ("layer_wise_bf16", "layer_wise_reduce_scatter_bf16", "tensor_parallel_bf16",
                                    "no_overlap_grad_reduce_bf16")])
def test_overlap_under_megatron_ddp_is_bitwise_the_plain_step(tmp_path, gen, cases):
    import torch.multiprocessing as mp

    import megatron_overlap_worker as worker

    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    rendezvous = os.path.join(str(tmp_path), "rendezvous")
    mp.spawn(worker.worker, args=(2, rendezvous, seed, cases), nprocs=2, join=True)


def test_install_checks_overlap_backward():
    from megatron_eopt.integrations import megatron as integration

    with pytest.raises(TypeError, match="overlap_backward"):
        integration.install(overlap_backward="yes")


@pytest.mark.gpu
@pytest.mark.distributed
def test_overlap_under_megatron_ddp_on_cuda_is_bitwise_the_plain_step(tmp_path, gen):
    """The same on CUDA over NCCL, one rank per GPU (the NCCL waits on the optimizer's side stream);
    tensor parallelism where there are two GPUs."""
    import torch.multiprocessing as mp

    import megatron_overlap_worker as worker

    world = min(torch.cuda.device_count(), 2)
    cases = ("chained_fp32", "chained_bf16", "layer_wise_bf16") + (("tensor_parallel_bf16",) if world == 2 else ())
    seed = int(torch.randint(0, 2**20, (1,), generator=gen))
    rendezvous = os.path.join(str(tmp_path), "rendezvous")
    mp.spawn(worker.gpu_worker, args=(world, rendezvous, seed, cases), nprocs=world, join=True)
