"""A few training steps of megatron-core's GPTModel under Megatron's DistributedDataParallel with
``get_megatron_optimizer(OptimizerConfig(optimizer="muon"))``, a checkpoint, and more steps:
with the plug installed the losses match Megatron's own TensorParallelMuon (Emerging-Optimizers),
and a job resumed from the checkpoint (torch_dist or torch format, ours or stock's) continues
with the losses of the job that never stopped.

Newton–Schulz runs in fp32 ("highest") on both sides, so the two optimizers differ only by fp32
rounding (different but equally exact products). The model is megatron_cpu's tiny GPT (2 layers,
hidden 64, GQA); DDP's CPU patch is megatron_cpu.megatron_ddp_on_cpu.
"""

import os

import pytest
import torch

from megatron_eopt.integrations import megatron as integration
from megatron_eopt.optim import TensorParallelMuon

import megatron_cpu  # noqa: E402

mcore_optimizer = megatron_cpu.megatron_optimizer_module()

pytestmark = pytest.mark.skipif(mcore_optimizer is None, reason="megatron-core is not installed")

BEFORE, AFTER = 3, 2  # steps before the checkpoint, steps after it
# fp32 Newton–Schulz on both sides; the losses after a few steps agree to ~1e-7 (docs/design.md §9: 1e-5).
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def megatron_env():
    import megatron_cpu

    if not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("the reference (Megatron's own TensorParallelMuon) needs emerging-optimizers")
    megatron_cpu.init_megatron_single_rank()
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield megatron_cpu
    finally:
        torch.set_float32_matmul_precision(precision)
        integration.uninstall()
        megatron_cpu.shutdown_megatron()


def _build(megatron_env, plug, seed):
    """A DDP-wrapped GPT and its optimizer from Megatron's factory, stock or with the plug."""
    integration.install() if plug else integration.uninstall()
    model = megatron_env.build_gpt(seed)
    ddp_model = megatron_env.wrap_in_megatron_ddp(model)
    config = mcore_optimizer.OptimizerConfig(
        optimizer="muon", lr=0.02, min_lr=0.0, weight_decay=0.1, clip_grad=0.0, bf16=False, fp16=False,
        muon_fp32_matmul_prec="highest",
    )
    with megatron_env.megatron_ddp_on_cpu(), megatron_env.megatron_optimizer_on_cpu():
        optimizer = mcore_optimizer.get_megatron_optimizer(config, [ddp_model])
    ours = any(isinstance(w.optimizer, TensorParallelMuon) for w in optimizer.chained_optimizers)
    assert ours == plug
    return ddp_model, optimizer


def _save(megatron_env, ddp_model, optimizer, ckpt_dir, fmt):
    """The model and optimizer as Megatron's checkpointing writes them, in format ``fmt``."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir)
    if fmt == "torch":
        state = {"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state, os.path.join(ckpt_dir, "model_optim.pt"))
        return
    model_sharded = ddp_model.module.sharded_state_dict()
    state = {"model": model_sharded, "optimizer": optimizer.sharded_state_dict(model_sharded)}
    with megatron_env.dist_checkpointing_on_cpu():
        dist_checkpointing.save(state, ckpt_dir)


def _load(megatron_env, ddp_model, optimizer, ckpt_dir, fmt):
    from megatron.core import dist_checkpointing

    if fmt == "torch":
        state = torch.load(os.path.join(ckpt_dir, "model_optim.pt"), weights_only=False)
    else:
        model_sharded = ddp_model.module.sharded_state_dict()
        sharded = {"model": model_sharded, "optimizer": optimizer.sharded_state_dict(model_sharded, is_loading=True)}
        with megatron_env.dist_checkpointing_on_cpu():
            state = dist_checkpointing.load(sharded, ckpt_dir)
    ddp_model.module.load_state_dict(state["model"])
    with megatron_env.megatron_optimizer_on_cpu():
        optimizer.load_state_dict(state["optimizer"])


def _rel(a, b):
    return abs(a - b) / abs(b)


def _train_save_continue(megatron_env, plug, data_seed, ckpt_dirs):
    """BEFORE steps, a checkpoint per format, AFTER more steps: all the losses."""
    ddp_model, optimizer = _build(megatron_env, plug, seed=5)
    losses = [megatron_env.train_step_ddp(ddp_model, optimizer, data_seed + i) for i in range(BEFORE)]
    for fmt, ckpt_dir in ckpt_dirs.items():
        _save(megatron_env, ddp_model, optimizer, ckpt_dir, fmt)
    losses += [megatron_env.train_step_ddp(ddp_model, optimizer, data_seed + BEFORE + i) for i in range(AFTER)]
    return losses


def _resume(megatron_env, plug, data_seed, ckpt_dir, fmt):
    """A fresh job (other init) that loads the checkpoint and runs the AFTER steps: their losses."""
    ddp_model, optimizer = _build(megatron_env, plug, seed=6)
    _load(megatron_env, ddp_model, optimizer, ckpt_dir, fmt)
    return [megatron_env.train_step_ddp(ddp_model, optimizer, data_seed + BEFORE + i) for i in range(AFTER)]


def test_gpt_training_matches_stock_and_resumes_exactly(megatron_env, tmp_path, gen):
    data_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    formats = ("torch_dist", "torch")
    dirs = {
        plug: {fmt: str(tmp_path / f"{'plug' if plug else 'stock'}_{fmt}") for fmt in formats} for plug in (False, True)
    }
    stock = _train_save_continue(megatron_env, False, data_seed, dirs[False])
    ours = _train_save_continue(megatron_env, True, data_seed, dirs[True])

    print(f"losses: ours {ours}, stock {stock}; largest relative difference "
          f"{max(_rel(a, b) for a, b in zip(ours, stock)):.2e}")
    assert ours[0] == stock[0]  # same model, same data, nothing stepped yet
    assert all(_rel(a, b) <= LOSS_TOLERANCE for a, b in zip(ours, stock)), (ours, stock)
    assert len(set(ours)) == len(ours)  # the optimizer moves the model: every step's loss differs

    for fmt in formats:
        # A job of ours that stopped and resumed from its checkpoint continues exactly (bitwise:
        # same state, same operations, same process).
        resumed = _resume(megatron_env, True, data_seed, dirs[True][fmt], fmt)
        print(f"resumed from {fmt}: {resumed} against {ours[BEFORE:]}")
        assert resumed == ours[BEFORE:], (fmt, resumed, ours[BEFORE:])
    # A stock job moved over to ours at its checkpoint continues as the stock job does.
    moved = _resume(megatron_env, True, data_seed, dirs[False]["torch_dist"], "torch_dist")
    assert all(_rel(a, b) <= LOSS_TOLERANCE for a, b in zip(moved, stock[BEFORE:])), (moved, stock[BEFORE:])
    # And ours moved back to stock.
    back = _resume(megatron_env, False, data_seed, dirs[True]["torch"], "torch")
    assert all(_rel(a, b) <= LOSS_TOLERANCE for a, b in zip(back, ours[BEFORE:])), (back, ours[BEFORE:])
