"""Checkpoints of Megatron-LM's hybrid layer-wise + distributed optimizer, with and without the plug.

What Megatron-LM's ``test_optimizer_common_state_dict_hybrid`` builds, re-expressed for
megatron-core alone: the GPT under Megatron's DistributedDataParallel with the layer-wise
parameter layout (``wrap_model_chunks_with_ddp(..., use_layer_wise_distributed_optimizer=True,
use_layer_wise_param_layout=True)``), and ``get_megatron_optimizer`` with
``use_layer_wise_distributed_optimizer=True`` and ``use_distributed_optimizer=True``: a
ChainedOptimizer of the LayerWiseDistributedOptimizer (Muon, whole matrices per rank) and a
DistributedOptimizer (Adam for the rest, sharded bytewise over DP). Its checkpoint goes through
``dist_checkpointing`` (torch_dist) with the DistributedOptimizer's sharding type
``dp_reshardable`` or ``fully_reshardable``.

Checked, for both sharding types (a dp_reshardable checkpoint written by stock, a
fully_reshardable one by ours): a fresh Muon member, stock's and ours, loads exactly the state
that was saved (param-group keys, hyper-parameters, state tensors), and ours and stock, loading
the same checkpoint, end with the same state dict as each other. The
second check rather than "equal to the saved one" for the whole chain: megatron-core's
DistributedOptimizer, which the plug does not touch, keeps the loader's own Adam ``step`` in its
param groups (stock does this too).

The ``torch`` format (megatron-core 0.19.2) covers the Muon member alone, through its own
``save_state_dict_to_file`` / ``load_state_dict_from_file`` (one file per rank, what
Megatron-LM's checkpointing calls for the layer-wise optimizer in that format): stock's file read
by ours and ours by stock, the state equal to the saved one. The whole chain has no torch-format
path in that release, on any device: Megatron-LM's ``save_checkpoint`` / ``load_checkpoint``
call those two methods on the optimizer ``get_megatron_optimizer`` returns, here a plain
ChainedOptimizer, which has neither (AttributeError); the DistributedOptimizer's
``state_dict()`` holds its param groups only, its Adam state going through
``save_parameter_state``, which Megatron-LM skips in the layer-wise mode (its argument parser
turns ``use_distributed_optimizer`` off there) and which, called directly, asserts a gloo
data-parallel group that the layer-wise builder does not create (``use_gloo_process_groups=False``).

CPU patches (the same for stock and plug): megatron_cpu.megatron_ddp_on_cpu, the layer-wise
worker's on_cpu (see megatron_layer_wise_worker.py) and adam_step_left_to_its_own_loader below.
"""

from __future__ import annotations

import contextlib
import os
import sys
import typing

import torch
import torch.distributed as dist

if not hasattr(typing, "override"):  # Megatron / Emerging-Optimizers import it (Python >= 3.12)
    import typing_extensions

    typing.override = typing_extensions.override

sys.path.insert(0, os.path.dirname(__file__))

import megatron_cpu  # noqa: E402
import megatron_layer_wise_worker as layer_wise  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

# sharding type -> whether ours writes the checkpoint (stock's is read by ours and by stock, and ours too)
WRITER_IS_OURS = {"dp_reshardable": False, "fully_reshardable": True}


@contextlib.contextmanager
def adam_step_left_to_its_own_loader():
    """megatron-core 0.19.2's fully_reshardable loader with torch's AdamW (its fallback without
    Transformer Engine / Apex, i.e. on a CPU): AdamW keeps "step" as a per-parameter tensor, the
    loader restores "step" apart and leaves it out of the tensors it copies, then looks it up
    among them (KeyError). Here a missing key counts as "nothing to copy", which the loader
    already does for non-tensor entries. Megatron's GPU optimizers have no such tensor.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        missing = {key: None for key in self.optimizer.state[main_param] if key not in tensors}
        return original(self, model_param, {**missing, **tensors})

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original


def build_hybrid(plug, seed, steps, not_muon=(), clip_grad=0.0):
    """A bf16 GPT under Megatron DDP (layer-wise layout) and its hybrid optimizer, after ``steps``
    steps; the parameters named in ``not_muon`` are marked ``use_muon = False``."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.training.training import wrap_model_chunks_with_ddp

    from megatron_eopt.integrations import megatron as integration
    from megatron_eopt.optim import TensorParallelMuon

    integration.install() if plug else integration.uninstall()
    model = megatron_cpu.build_gpt(seed, bf16=True)
    for name in not_muon:
        dict(model.named_parameters())[name].use_muon = False
    config = mcore_optimizer.OptimizerConfig(
        optimizer="muon", use_layer_wise_distributed_optimizer=True, use_distributed_optimizer=True, lr=0.02,
        min_lr=0.0, weight_decay=0.1, clip_grad=clip_grad, bf16=True, params_dtype=torch.bfloat16,
    )
    with megatron_cpu.megatron_ddp_on_cpu(), layer_wise.on_cpu():
        (ddp_model,) = wrap_model_chunks_with_ddp(
            [model], model.config, DistributedDataParallelConfig(use_distributed_optimizer=True),
            use_layer_wise_distributed_optimizer=True, use_layer_wise_param_layout=True, DP=DistributedDataParallel,
        )
        optimizer = mcore_optimizer.get_megatron_optimizer(config, [ddp_model])
    for step in range(steps):
        with layer_wise.on_cpu():
            megatron_cpu.train_step_ddp(ddp_model, optimizer, seed * 10 + step)
    muon_part, adam_part = optimizer.chained_optimizers
    assert isinstance(muon_part, LayerWiseDistributedOptimizer)
    assert type(adam_part).__name__ == "DistributedOptimizer"
    ours = any(isinstance(m, TensorParallelMuon) for m in layer_wise.layer_wise_members(muon_part))
    assert ours == plug
    return ddp_model, optimizer


def checkpoint_metadata(sharding_type):
    """The sharded-state-dict metadata Megatron-LM's save_checkpoint / load_checkpoint pass."""
    return {"distrib_optim_sharding_type": sharding_type, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


def save(ddp_model, optimizer, ckpt_dir, sharding_type):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir)
    dist.barrier()
    metadata = checkpoint_metadata(sharding_type)
    with megatron_cpu.megatron_ddp_on_cpu(), layer_wise.on_cpu(), megatron_cpu.dist_checkpointing_on_cpu():
        sharded = optimizer.sharded_state_dict(ddp_model.module.sharded_state_dict(), metadata=metadata)
        dist_checkpointing.save(sharded, ckpt_dir)


def load(ddp_model, optimizer, ckpt_dir, sharding_type):
    """Loads as Megatron does; the optimizer's state_dict() after."""
    from megatron.core import dist_checkpointing

    metadata = checkpoint_metadata(sharding_type)
    with megatron_cpu.megatron_ddp_on_cpu(), layer_wise.on_cpu(), megatron_cpu.dist_checkpointing_on_cpu(), \
            adam_step_left_to_its_own_loader():
        model_sharded = ddp_model.module.sharded_state_dict()
        sharded = optimizer.sharded_state_dict(model_sharded, is_loading=True, metadata=metadata)
        optimizer.load_state_dict(dist_checkpointing.load(sharded, ckpt_dir))
    return optimizer.state_dict()


def check_hybrid(ckpt_root, where, seed):
    for sharding_type, writer_plug in WRITER_IS_OURS.items():
        ckpt_dir = os.path.join(ckpt_root, sharding_type)
        ddp_model, optimizer = build_hybrid(writer_plug, seed=seed, steps=2)
        save(ddp_model, optimizer, ckpt_dir, sharding_type)
        saved_muon = optimizer.chained_optimizers[0].state_dict()
        loaded = {}
        # The readers have stepped once: megatron-core's DistributedOptimizer gives a state dict
        # only once Adam has state (stock as well).
        for reader_plug in (False, True):
            reader = build_hybrid(reader_plug, seed=seed + 1, steps=1)
            loaded[reader_plug] = load(*reader, ckpt_dir, sharding_type)
            case = f"{where} {sharding_type} written by plug={writer_plug} read by plug={reader_plug}"
            loaded_muon = reader[1].chained_optimizers[0].state_dict()
            layer_wise.assert_param_group_keys_as_saved(saved_muon, loaded_muon, case)
            megatron_cpu.assert_same_state(saved_muon, loaded_muon, case)
        megatron_cpu.assert_same_state(loaded[False], loaded[True], f"{where} {sharding_type} stock, ours alike")
        check_muon_member_torch_format(optimizer, writer_plug, os.path.join(ckpt_root, "torch", sharding_type),
                                       f"{where} torch format written by plug={writer_plug}", seed)


def check_muon_member_torch_format(optimizer, writer_plug, ckpt_dir, where, seed):
    """The writer's Muon member in the torch format, read by a fresh reader of the other kind
    (another seed: a load that left the reader's own state would show)."""
    # Once the chain has a torch-format entry point of its own (see the module docstring), it is
    # the one to test here, Adam's state included.
    assert not hasattr(optimizer, "save_state_dict_to_file"), where
    os.makedirs(ckpt_dir, exist_ok=True)
    path = os.path.join(ckpt_dir, f"layer_wise_optimizer_{dist.get_rank()}.pt")
    reader = build_hybrid(not writer_plug, seed=seed + 5, steps=0)
    saved, loaded = layer_wise.torch_format_round_trip(
        (None, optimizer.chained_optimizers[0]), (None, reader[1].chained_optimizers[0]), path
    )
    layer_wise.assert_param_group_keys_as_saved(saved, loaded, where)
    megatron_cpu.assert_same_state(saved, loaded, where)


def check_use_muon_false_trains(where, seed):
    """A 2-D weight marked ``use_muon = False`` goes to Adam in the DistributedOptimizer, and
    trains. (megatron-core 0.19.2's layer-wise buffer rule ignores the flag; install() aligns it
    with the routing. Stock 0.19.2 ignores the flag altogether and gives the weight to Muon.)"""
    excluded = "decoder.layers.0.mlp.linear_fc1.weight"
    ddp_model, optimizer = build_hybrid(True, seed=seed + 3, steps=0, not_muon=[excluded])
    params = dict(ddp_model.module.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    with layer_wise.on_cpu():
        megatron_cpu.train_step_ddp(ddp_model, optimizer, seed=seed + 4)
    assert params[excluded].is_managed_by_layer_wise_optimizer is False, where
    assert params["decoder.layers.1.mlp.linear_fc1.weight"].is_managed_by_layer_wise_optimizer is True, where
    frozen = [name for name, p in params.items() if torch.equal(p, before[name])]
    assert not frozen, (where, frozen)


def check_resharded_load(ckpt_root, where, seed):
    """check_hybrid's checkpoints loaded at another DP size by stock and by ours: ours must end with
    exactly the state stock ends with, and its Muon state must be the checkpoint's, not its own."""
    for sharding_type in WRITER_IS_OURS:
        ckpt_dir = os.path.join(ckpt_root, sharding_type)
        by_stock = load(*build_hybrid(False, seed=seed + 2, steps=1), ckpt_dir, sharding_type)
        reader = build_hybrid(True, seed=seed + 2, steps=1)
        before = layer_wise.state_tensors(reader[1].chained_optimizers[0].state_dict())
        by_plug = load(*reader, ckpt_dir, sharding_type)
        after = reader[1].chained_optimizers[0].state_dict()
        layer_wise.assert_changed_by_load(before, after, f"{where} {sharding_type}")
        megatron_cpu.assert_same_state(by_stock, by_plug, f"{where} {sharding_type}")


@exits_without_teardown
def worker(rank, world_size, init_file, ckpt_root, seed):
    with megatron_cpu.megatron_world(rank, world_size, init_file):
        check_use_muon_false_trains(f"rank {rank}/{world_size}", seed)
        check_hybrid(ckpt_root, f"rank {rank}/{world_size}", seed)
