"""Checkpoints of Megatron-LM's layer-wise distributed optimizer (``dist_muon``) on the CPU.

What Megatron-LM's own dist_checkpointing tests check for this optimizer (its save/load and
common-state-dict tests), re-expressed for megatron-core alone and run over gloo: build a model
and ``get_megatron_optimizer(OptimizerConfig(optimizer="dist_muon", bf16=True))``, train, save a
checkpoint, build a fresh model and optimizer (another seed), load, and the optimizer's
``state_dict()`` must equal the saved one on every rank: param groups with the same keys and
hyper-parameters, the same state tensors. Checked for the ``torch_dist`` format (Megatron's
``dist_checkpointing`` with the optimizer's ``sharded_state_dict``; its param groups travel in
the common state dict that rank 0 writes) and the ``torch`` format (each rank ``torch.save``s the
optimizer's ``state_dict()`` to a file of its own), for ours into ours and crosswise with Megatron's own
``TensorParallelMuon`` (Emerging-Optimizers 0.3.0).

megatron-core 0.19.2 wraps the layer-wise optimizer's members only for bf16, in
``Float16OptimizerWithFloat16Params``, which takes CUDA tensors only; megatron_cpu's
``mixed_precision_wrapper_on_cpu`` and ``megatron_optimizer_on_cpu`` let it take CPU ones, and
``on_cpu`` below swaps its gloo-incompatible parameter all-gather for its own broadcast. Stock and
plug runs get exactly the same patches.
"""

from __future__ import annotations

import contextlib
import os
import sys
import typing
import warnings

import torch
import torch.distributed as dist

if not hasattr(typing, "override"):  # Megatron / Emerging-Optimizers import it (Python >= 3.12)
    import typing_extensions

    typing.override = typing_extensions.override

sys.path.insert(0, os.path.dirname(__file__))

import megatron_cpu  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

# (optimizer name, the checkpoint's writer is ours, its reader is ours)
CASES = (("muon", True, True), ("muon", False, True), ("muon", True, False), ("adaptive_muon", True, True))
# Every case runs on one rank (in the test process). Four ranks run the muon cross-loads in the
# torch_dist format and resharding (write_and_cross_load, check_resharded_load); the torch format
# writes one file per rank with that rank's state alone, so its one-rank check covers it.
# Cases whose optimizer the four-rank run leaves out also run on two ranks (cases_worker): there
# each rank owns only some of the weights, so the torch_dist checkpoint must put every weight's
# state (adaptive_muon's second moment included) back on its owner.
TWO_RANK_CASES = tuple(case for case in CASES if case[0] != "muon")


@contextlib.contextmanager
def on_cpu():
    """Megatron's layer-wise optimizer on CPU tensors and gloo (see the module docstring).

    After its step each rank sends the parameters it updated to the others. megatron-core does
    that with one all_gather of unequal sizes (fine on NCCL; gloo refuses it), or with its
    ``broadcast_params``, which sends the same parameters from the same ranks one by one: the
    latter is used here.
    """
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    allgather = LayerWiseDistributedOptimizer.allgather_params
    LayerWiseDistributedOptimizer.allgather_params = LayerWiseDistributedOptimizer.broadcast_params
    try:
        with megatron_cpu.megatron_optimizer_on_cpu(), megatron_cpu.mixed_precision_wrapper_on_cpu():
            yield
    finally:
        LayerWiseDistributedOptimizer.allgather_params = allgather


def layer_wise_config(name):
    import megatron.core.optimizer as mcore_optimizer

    return mcore_optimizer.OptimizerConfig(
        optimizer=f"dist_{name}", lr=0.02, min_lr=0.0, weight_decay=0.1, clip_grad=0.0, bf16=True, fp16=False,
        params_dtype=torch.bfloat16, muon_tp_mode="duplicated",
    )


def layer_wise_members(optimizer):
    """The torch optimizers inside a LayerWiseDistributedOptimizer (itself a ChainedOptimizer)."""
    return [wrapper.optimizer for wrapper in optimizer.chained_optimizers]


def build_layer_wise(name, plug, seed, steps):
    """A bf16 GPT and its dist_<name> optimizer, after ``steps`` training steps."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    from megatron_eopt.integrations import megatron as integration
    from megatron_eopt.optim import TensorParallelMuon

    integration.install() if plug else integration.uninstall()
    model = megatron_cpu.build_gpt(seed, bf16=True)
    with on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "dist_muon" is Megatron's older spelling
        optimizer = mcore_optimizer.get_megatron_optimizer(layer_wise_config(name), [model])
        for step in range(steps):
            megatron_cpu.forward_backward(model, seed * 10 + step)
            assert optimizer.step()[0]
    assert isinstance(optimizer, LayerWiseDistributedOptimizer)
    # Every rank holds a Muon member (its param groups may be empty on some ranks).
    ours = [isinstance(member, TensorParallelMuon) for member in layer_wise_members(optimizer)]
    assert any(ours) == plug, (name, plug, [type(m).__name__ for m in layer_wise_members(optimizer)])
    return model, optimizer


def save_torch_dist(model, optimizer, ckpt_dir):
    """Megatron's torch_dist save of the optimizer's sharded state dict (every rank takes part)."""
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir)
    dist.barrier()
    with on_cpu(), megatron_cpu.dist_checkpointing_on_cpu():
        dist_checkpointing.save(optimizer.sharded_state_dict(model.sharded_state_dict()), ckpt_dir)


def load_torch_dist(model, optimizer, ckpt_dir):
    """Loads a torch_dist checkpoint into the optimizer as Megatron does; its state_dict() after."""
    from megatron.core import dist_checkpointing

    with on_cpu(), megatron_cpu.dist_checkpointing_on_cpu():
        sharded = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
        optimizer.load_state_dict(dist_checkpointing.load(sharded, ckpt_dir))
    return optimizer.state_dict()


def torch_format_round_trip(source, target, path):
    """Megatron's ``torch`` format for this optimizer: each rank writes its state_dict() to a file
    of its own (``save_state_dict_to_file``, torch.save) and reads it back (``load_state_dict_from_file``)."""
    (_, opt_a), (_, opt_b) = source, target
    opt_a.save_state_dict_to_file(path)
    with on_cpu():
        opt_b.load_state_dict_from_file(path)
    return opt_a.state_dict(), opt_b.state_dict()


def state_tensors(state_dict):
    """The optimizer-state tensors of a (chained) Megatron optimizer's state_dict(), in order."""
    members = state_dict if isinstance(state_dict, list) else [state_dict]
    return [
        tensor.clone()
        for member in members
        for param_state in member["optimizer"]["state"].values()
        for tensor in param_state.values()
        if torch.is_tensor(tensor) and tensor.dim() > 0
    ]


def assert_changed_by_load(before, after, where):
    """The load brought state of its own: some state tensor differs from what the reader had."""
    after = state_tensors(after)
    assert after, where
    assert len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after)), where


def assert_param_group_keys_as_saved(saved, loaded, where):
    """The check of Megatron's common-state-dict test, spelled out: same keys, same hyper-parameters.

    ``saved`` / ``loaded``: a ChainedOptimizer's state_dict(), a list (one dict per member) or,
    with a single member, that member's dict.
    """
    if isinstance(saved, dict):
        saved, loaded = [saved], [loaded]
    assert len(saved) == len(loaded), where
    for i, (a, b) in enumerate(zip(saved, loaded)):
        for j, (group_a, group_b) in enumerate(zip(a["optimizer"]["param_groups"], b["optimizer"]["param_groups"])):
            assert list(group_a) == list(group_b), (where, i, j, list(group_a), list(group_b))
            assert {k: v for k, v in group_a.items() if k != "params"} == {
                k: v for k, v in group_b.items() if k != "params"
            }, (where, i, j)


def check_case(name, source_plug, target_plug, ckpt_dir, where, seed):
    """One writer / reader pair: torch_dist, then torch format, each into a fresh optimizer (one
    that has not stepped, as when a job resumes; Megatron creates its state to load into)."""
    source = build_layer_wise(name, source_plug, seed=seed, steps=2)
    save_torch_dist(*source, ckpt_dir)
    loaded = load_torch_dist(*build_layer_wise(name, target_plug, seed=seed + 1, steps=0), ckpt_dir)
    saved = source[1].state_dict()
    assert_param_group_keys_as_saved(saved, loaded, f"{where} torch_dist")
    megatron_cpu.assert_same_state(saved, loaded, f"{where} torch_dist")
    path = os.path.join(ckpt_dir, f"optimizer_rank{dist.get_rank()}.pt")
    saved, loaded = torch_format_round_trip(source, build_layer_wise(name, target_plug, seed=seed + 2, steps=0), path)
    assert_param_group_keys_as_saved(saved, loaded, f"{where} torch")
    megatron_cpu.assert_same_state(saved, loaded, f"{where} torch")


def run_cases(cases, ckpt_root, where, seed):
    for i, case in enumerate(cases):
        check_case(*case, os.path.join(ckpt_root, f"case{i}"), f"{where} case {case}", seed + 10 * i)


def writer_dir(ckpt_root, writer_plug):
    return os.path.join(ckpt_root, f"written_by_{'plug' if writer_plug else 'stock'}")


def write_and_cross_load(ckpt_root, where, seed):
    """Stock and ours each train and save (torch_dist) at the current parallel sizes; a fresh
    optimizer of the other kind loads the checkpoint and must hold exactly the saved state (each
    rank owns a different subset of the weights, and its state must come back to it)."""
    for writer_plug in (False, True):
        model, optimizer = build_layer_wise("muon", writer_plug, seed=seed, steps=2)
        save_torch_dist(model, optimizer, writer_dir(ckpt_root, writer_plug))
        reader = build_layer_wise("muon", not writer_plug, seed=seed + 1, steps=0)
        loaded = load_torch_dist(*reader, writer_dir(ckpt_root, writer_plug))
        saved = optimizer.state_dict()
        assert_param_group_keys_as_saved(saved, loaded, f"{where} written by plug={writer_plug}")
        megatron_cpu.assert_same_state(saved, loaded, f"{where} written by plug={writer_plug}")


def check_resharded_load(ckpt_root, where, seed):
    """write_and_cross_load's checkpoints, loaded at other parallel sizes (the weights move to
    other owners, their TP shards are joined) by stock and by ours: ours must end with exactly
    the state stock ends with. Ours has stepped once before loading, so that state must come
    from the checkpoint."""
    for writer_plug in (False, True):
        ckpt_dir = writer_dir(ckpt_root, writer_plug)
        by_stock = load_torch_dist(*build_layer_wise("muon", False, seed=seed + 2, steps=0), ckpt_dir)
        reader = build_layer_wise("muon", True, seed=seed + 2, steps=1)
        before = state_tensors(reader[1].state_dict())
        by_plug = load_torch_dist(*reader, ckpt_dir)
        assert_changed_by_load(before, by_plug, f"{where} written by plug={writer_plug}")
        megatron_cpu.assert_same_state(by_stock, by_plug, f"{where} written by plug={writer_plug}")


@exits_without_teardown
def worker(rank, world_size, init_file, ckpt_root, seed):
    with megatron_cpu.megatron_world(rank, world_size, init_file, tensor_parallel=2):
        write_and_cross_load(ckpt_root, f"rank {rank}/{world_size} TP=2 DP=2", seed)
        dist.barrier()
        megatron_cpu.use_model_parallel(1)
        check_resharded_load(ckpt_root, f"rank {rank}/{world_size} TP=1 DP=4", seed)


@exits_without_teardown
def cases_worker(rank, world_size, init_file, ckpt_root, seed, cases):
    """run_cases on every rank at TP = 1 x DP = world_size."""
    with megatron_cpu.megatron_world(rank, world_size, init_file):
        run_cases(cases, ckpt_root, f"rank {rank}/{world_size} TP=1 DP={world_size}", seed)
