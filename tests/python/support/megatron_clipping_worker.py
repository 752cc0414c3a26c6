"""Muon-aware clipping in Megatron-LM's layer-wise distributed optimizer, on gloo ranks (CPU).

Every rank trains the same bf16 GPT on the same tokens, so its gradients are the one-rank run's;
the layer-wise optimizer gives each rank whole parameters to update, so each rank holds only some
of the gradients a norm needs and the norms must be reduced over the world. Each rank also trains
a one-rank chained optimizer (no layer-wise sharding) on the same gradients: the reported norm, the
parts' norms and the parameters must agree.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import megatron_cpu  # noqa: E402
from megatron_layer_wise_worker import layer_wise_config, on_cpu  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

GRAD_SCALE = 1e4


def _scaled_grads(model, seed, scale):
    megatron_cpu.forward_backward(model, seed)
    for p in model.parameters():
        p.main_grad = p.grad.float() * scale


def _train(optimizer_name, config_fields, seed, steps, scale=GRAD_SCALE):
    import megatron.core.optimizer as mcore_optimizer

    model = megatron_cpu.build_gpt(seed, bf16=True)
    config = layer_wise_config("muon")
    config.optimizer = optimizer_name
    config.clip_grad = 1.0
    for key, value in config_fields.items():
        setattr(config, key, value)
    norms = []
    with on_cpu(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "dist_muon" is Megatron's older spelling
        optimizer = mcore_optimizer.get_megatron_optimizer(config, [model])
        for step in range(steps):
            _scaled_grads(model, seed * 10 + step, scale)
            success, grad_norm, _ = optimizer.step()
            assert success
            norms.append((grad_norm, dict(optimizer.grad_norms_by_part)))
    return model, optimizer, norms


def check_layer_wise_matches_one_rank(seed, where):
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    from megatron_eopt.integrations import megatron as integration

    integration.install()
    model, optimizer, norms = _train("dist_muon", {}, seed, steps=2)
    assert isinstance(optimizer, LayerWiseDistributedOptimizer), where
    owned = sum(len(member.get_parameters()) for member in optimizer.chained_optimizers)
    assert 0 < owned < len(list(model.parameters())), (where, owned)  # each rank updates only some
    _assert_matches_one_rank(model, norms, seed, GRAD_SCALE, where)


def _assert_matches_one_rank(model, norms, seed, scale, where):
    """The one-rank chained optimizer on the same gradients: the same norms, parts and parameters."""
    ref_model, _, ref_norms = _train("muon", {"use_layer_wise_distributed_optimizer": False}, seed, 2, scale)
    assert len(norms) == len(ref_norms) == 2, where
    for (norm, parts), (ref_norm, ref_parts) in zip(norms, ref_norms):
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (where, norm, ref_norm)
        for part in ("muon", "adamw"):
            assert abs(parts[part] - ref_parts[part]) <= 1e-5 * ref_parts[part], (where, part, parts, ref_parts)
    ref = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().float(), ref[name].detach().float(), rtol=8e-3, atol=1e-5,
                                   msg=f"{where} {name}")


def check_hybrid_matches_one_rank(seed, where):
    """The layer-wise optimizer (Muon) chained with a DistributedOptimizer (Adam, sharded bytewise)
    under Megatron DDP, every rank on the same tokens: the norms reduce over both and clip_grad=1.0
    (the gradients' norm is ~1-10) clips the Adam part."""
    import megatron_hybrid_worker as hybrid

    ddp_model, optimizer = hybrid.build_hybrid(True, seed, steps=0, clip_grad=1.0)
    norms = []
    for step in range(2):
        with on_cpu():
            megatron_cpu.train_step_ddp(ddp_model, optimizer, seed * 10 + step)
        parts = dict(optimizer.grad_norms_by_part)
        norms.append(((parts["muon"] ** 2 + parts["adamw"] ** 2) ** 0.5, parts))
    assert norms[0][1]["adamw"] > 1.0, (where, norms)
    _assert_matches_one_rank(ddp_model.module, norms, seed, 1.0, where)


@exits_without_teardown
def layer_wise_worker(rank, world_size, init_file, seed):
    with megatron_cpu.megatron_world(rank, world_size, init_file):
        check_layer_wise_matches_one_rank(seed, f"rank {rank}/{world_size} layer-wise")
        dist.barrier()
        check_hybrid_matches_one_rank(seed, f"rank {rank}/{world_size} layer-wise + distributed optimizer")
        dist.barrier()
