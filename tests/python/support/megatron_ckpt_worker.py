"""One rank of the Megatron-LM checkpoint test at tensor parallel size 2 (spawned by
test_megatron_integration.py; gloo on CPU).

Each rank builds megatron-core's GPTModel with TP = 2 (the attention and MLP weights are sharded
across the two ranks), gets its optimizer from ``get_megatron_optimizer`` and trains a step; a
torch_dist ``dist_checkpointing`` save of the optimizer's sharded state dict is loaded into a
fresh optimizer (another model seed), whose state dict must then equal the saved one: ours into
ours, Megatron's own TensorParallelMuon (Emerging-Optimizers) into ours and ours into Megatron's.
"""

from __future__ import annotations

import os
import sys
import typing

import torch.distributed as dist

if not hasattr(typing, "override"):  # Megatron / Emerging-Optimizers import it (Python >= 3.12)
    import typing_extensions

    typing.override = typing_extensions.override

sys.path.insert(0, os.path.dirname(__file__))

import megatron_cpu  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

CASES = (("muon", True, True), ("adaptive_muon", True, True), ("muon", False, True), ("muon", True, False))


def _config(name):
    import megatron.core.optimizer as mcore_optimizer

    return mcore_optimizer.OptimizerConfig(
        optimizer=name, lr=0.02, min_lr=0.0, weight_decay=0.1, clip_grad=0.0, bf16=False, fp16=False,
        muon_tp_mode="duplicated",
    )


def _trained(name, plug, seed, steps):
    import megatron.core.optimizer as mcore_optimizer
    from megatron_eopt.integrations import megatron as integration
    from megatron_eopt.optim import TensorParallelMuon

    integration.install() if plug else integration.uninstall()
    model = megatron_cpu.build_gpt(seed)
    with megatron_cpu.megatron_optimizer_on_cpu():
        chained = mcore_optimizer.get_megatron_optimizer(_config(name), [model])
        for step in range(steps):
            megatron_cpu.forward_backward(model, seed * 10 + step)
            assert chained.step()[0]
    ours = any(isinstance(w.optimizer, TensorParallelMuon) for w in chained.chained_optimizers)
    assert ours == plug, (name, plug)
    return model, chained


@exits_without_teardown
def worker(rank, world_size, init_file, ckpt_root):
    from megatron.core import dist_checkpointing

    with megatron_cpu.megatron_world(rank, world_size, init_file, tensor_parallel=world_size):
        for i, (name, source_plug, target_plug) in enumerate(CASES):
            ckpt_dir = os.path.join(ckpt_root, f"case{i}")
            if rank == 0:
                os.makedirs(ckpt_dir)
            dist.barrier()
            model_a, opt_a = _trained(name, source_plug, seed=21, steps=2)
            model_b, opt_b = _trained(name, target_plug, seed=22, steps=1)
            shard = [n for n, p in model_a.named_parameters() if getattr(p, "tensor_model_parallel", False)]
            assert shard, "TP = 2 shards no parameter"
            with megatron_cpu.dist_checkpointing_on_cpu():
                dist_checkpointing.save(opt_a.sharded_state_dict(model_a.sharded_state_dict()), ckpt_dir)
                loaded = dist_checkpointing.load(
                    opt_b.sharded_state_dict(model_b.sharded_state_dict(), is_loading=True), ckpt_dir
                )
            opt_b.load_state_dict(loaded)
            megatron_cpu.assert_same_state(opt_a.state_dict(), opt_b.state_dict(), f"rank {rank} case {CASES[i]}")
            dist.barrier()
