"""One rank of the tests of megatron-core's own FSDP2 wrapper with our optimizers (test_megatron_fsdp2.py).

A GPT (megatron_cpu.build_gpt) in megatron-core's ``TorchFullyShardedDataParallel`` (PyTorch FSDP2:
every parameter a ``Shard(0)`` DTensor over the data-parallel ranks) and its optimizer from
``get_megatron_optimizer`` with our ``install()``, against the same GPT in Megatron's
``DistributedDataParallel`` with the same optimizer: same initial weights, same batches (each rank its
own), 3 steps; the full parameters must agree. Cases: CASES below (muon and adaptive_muon, fp32 and
bf16, muon_split_qkv on and off; NorMuon and NAMO too). Under FSDP2 our optimizer orthogonalizes each sharded
matrix on one owner rank (the sharded path, owner mode); under DDP each rank steps whole matrices.

What may differ, measured on gloo: nothing. The owner runs Newton–Schulz on the same full matrix
as DDP, and with 2 ranks the two reductions of the gradients (DDP's all-reduce, FSDP2's
reduce-scatter) add the same two terms, so every parameter comes out bitwise equal, for fp32 and
bf16. With 4 ranks the two reductions add their terms in different orders: with different data on each
rank the Muon matrices then differ by up to 1e-5 of their update, and the sign-like steps
amplify those roundings (Adam on the key bias, whose gradient is rounding noise: 6e-4; AdaMuon, whose
first step is about sign(u) / sqrt(1 - beta2): 3e-2 in fp32 and O(1) in bf16). Those differences are
the reductions', not the optimizer's, so the 4-rank case gives every rank the same batch (the sums of
equal terms do not depend on the order) and comes out bitwise equal too.

NorMuon and NAMO are the exception: their statistics over a sharded matrix are summed in pieces,
which rounds otherwise than DDP's whole sums (STATISTICS_TOL says what that gives).

The tolerances: fp32 parameters within FP32_TOL of their update's norm (the size of the 4-rank
roundings above, 0 measured); bf16 parameters at most one bf16 step apart elementwise, and their fp32
main copies (Megatron's mixed-precision wrapper) within FP32_TOL.

The checkpoint: torch.distributed.checkpoint (DCP) of the module's and the optimizer's state dicts
after step 2 under FSDP2, loaded into a fresh model and optimizer (another seed); step 3 must equal
the uninterrupted run's bitwise.
"""

from __future__ import annotations

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
from worker_exit import exits_without_teardown  # noqa: E402

STEPS = 3
FP32_TOL = 1e-5  # relative to the norm of the parameter's update (see the module docstring)
# NorMuon and NAMO sum their statistics over a sharded matrix in per-shard pieces (then all-reduced):
# fp32 roundings DDP's whole sums do not make, which the following steps carry on. Measured over 16
# seeds: Muon matrices up to 3.7e-6 of their update (within FP32_TOL; see SPANNING_MATRIX_TOL), the Adam parameters up to
# 3.9e-4 (the key bias again, whose gradient is rounding noise that Adam normalizes), hence this
# tolerance for the latter. In bf16 a rounding of that size now and then moves a weight by one bf16
# step and the runs part (1 seed in 6), so those cases run in fp32.
STATISTICS_TOL = 2e-3
# ... and the Muon matrices themselves: the per-shard sums reach their normalized updates (NAMO's
# adaptive step size, NorMuon's row statistics), up to 7.0e-5 of the update with seed 1542318318
# (NAMO, the QKV projection), above FP32_TOL
SPANNING_MATRIX_TOL = 2e-4
SPANNING_STATISTICS = ("normuon", "namo")
BF16_STEP = torch.finfo(torch.bfloat16).eps  # spacing of bf16 numbers relative to their magnitude (at most)
# (optimizer name, bf16, muon_split_qkv, adaptive_muon_moment2_method): every combination of the first
# three on 2 ranks (AdaMuon's second moment), and NorMuon's and NAMO's (fp32, see STATISTICS_TOL),
# whose statistics span the shards of a matrix. The adaptive variants scale each QKV part after their normalization by its
# place in the whole projection; Megatron's default scale mode ("spectral", sqrt(max(rows, cols)))
# gives this model's q part (64 x 64) and k / v parts (32 x 64) the same scale, so they run with
# "unit_rms_norm" (sqrt(rows / cols): 1 and 0.71).
CASES = tuple(
    (name, bf16, split, None if name == "muon" else "adamuon")
    for name in ("muon", "adaptive_muon")
    for bf16 in (False, True)
    for split in (True, False)
) + (("adaptive_muon", False, True, "normuon"), ("adaptive_muon", False, True, "namo"))
# 4 ranks: the fused QKV rows of a query group split over two ranks (q on one, k and v on the next)
FOUR_RANK_CASES = (("muon", False, True, None), ("adaptive_muon", True, True, "adamuon"))
CHECKPOINT_CASES = (
    ("muon", False, True, None),
    ("adaptive_muon", True, True, "adamuon"),
    ("adaptive_muon", False, True, "normuon"),
)
# Muon-aware clipping (install()'s "adamw" policy) at a clip_grad every step's gradients exceed: the
# norms of FSDP2's DTensor gradient shards, reduced over their mesh, against DDP's whole gradients.
# The Adam part's norm is summed in per-shard pieces, so its clip coefficient rounds otherwise than
# DDP's (a few 1e-8 relative); Adam's first steps are sign-like, so on the elements whose gradient is
# rounding noise that difference can flip an update. As for NorMuon and NAMO (STATISTICS_TOL), the
# Adam parameters get the loose tolerance and the cases run in fp32: in bf16 one such flip moves a
# weight by more than one bf16 step and the runs part (seen in 1 of a few dozen runs). The Muon matrices
# then see the Adam parameters' differences in the next steps' gradients: measured over 460 seeds, up
# to 4.4e-6 of their update under Muon and 2.2e-5 under AdaMuon (whose sign-like normalization
# amplifies them), beyond FP32_TOL; they get SPANNING_MATRIX_TOL as well.
CLIP_CASES = (("muon", False, True, None), ("adaptive_muon", False, True, "adamuon"))
CLIP_GRAD = 1e-3
SCALE_MODE = {"muon": "spectral", "adaptive_muon": "unit_rms_norm"}
MUON_MATRICES = 9  # per step: 2 layers x (qkv, proj, fc1, fc2) and the position embedding


def optimizer_config(name, bf16, split_qkv, moment2_method, clip_grad=0.0):
    import megatron.core.optimizer as mcore_optimizer

    return mcore_optimizer.OptimizerConfig(
        optimizer=name,
        lr=0.02,
        min_lr=0.0,
        weight_decay=0.1,
        clip_grad=clip_grad,
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        muon_fp32_matmul_prec="highest",
        muon_split_qkv=split_qkv,
        muon_scale_mode=SCALE_MODE[name],
        **({} if moment2_method is None else {"adaptive_muon_moment2_method": moment2_method}),
    )


def build(wrap, name, bf16, split_qkv, moment2_method, seed, clip_grad=0.0):
    """A GPT wrapped by ``wrap`` and its optimizer from Megatron's factory (our install() in place)."""
    import megatron.core.optimizer as mcore_optimizer

    wrapped = wrap(megatron_cpu.build_gpt(seed, bf16=bf16))
    with on_cpu():
        optimizer = mcore_optimizer.get_megatron_optimizer(
            optimizer_config(name, bf16, split_qkv, moment2_method, clip_grad), [wrapped]
        )
    return wrapped, optimizer


def on_cpu():
    """Megatron's DDP and optimizer wrappers (mixed precision included) on CPU tensors (megatron_cpu)."""
    import contextlib

    stack = contextlib.ExitStack()
    for context in (
        megatron_cpu.megatron_ddp_on_cpu(),
        megatron_cpu.megatron_optimizer_on_cpu(),
        megatron_cpu.mixed_precision_wrapper_on_cpu(),
    ):
        stack.enter_context(context)
    return stack


def train(wrapped, optimizer, data_seed, steps, same_data=False, first=0):
    """Steps ``first`` .. ``first + steps - 1``; each rank its own batch (all the same with same_data)."""
    world, rank = dist.get_world_size(), 0 if same_data else dist.get_rank()
    with on_cpu():
        for step in range(first, first + steps):
            megatron_cpu.train_step_ddp(wrapped, optimizer, data_seed + step * world + rank)


def full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def parameters(wrapped):
    """{name: full parameter} and, for bf16 parameters, {name: full fp32 main copy}."""
    params, mains = {}, {}
    for name, p in wrapped.module.named_parameters():
        params[name] = full(p)
        if hasattr(p, "main_param"):
            mains[name] = full(p.main_param)
    return params, mains


def muon_member(optimizer):
    from megatron_eopt.optim import TensorParallelMuon

    members = [w.optimizer for w in optimizer.chained_optimizers if isinstance(w.optimizer, TensorParallelMuon)]
    assert len(members) == 1, [type(w.optimizer).__name__ for w in optimizer.chained_optimizers]
    return members[0]


def check_sharded_path(optimizer, split_qkv, moment2_method, world, where):
    """Our optimizer ran its sharded path: every Muon matrix a DTensor orthogonalized across the ranks
    (owner mode), the fused QKV weights with their split exactly when muon_split_qkv asks, the second
    moment asked for."""
    member = muon_member(optimizer)
    assert member._config.moment2_method == moment2_method, (where, member._config.moment2_method)
    ran = {mode: n for mode, n in member._sharded.matrices.items() if n}
    assert ran == {"owner": MUON_MATRICES * STEPS}, (where, ran)
    qkv = [e.split is not None for e in member._plan.entries if getattr(e.param, "is_qkv", False)]
    assert qkv == [split_qkv] * 2, (where, qkv)
    assert all(e.sharding.kind == "owner" and e.sharding.route.size == world for e in member._plan.entries), where


def assert_close(got, ref, init, where, tol=FP32_TOL, loose=(), loose_tol=FP32_TOL):
    """The module docstring's tolerances: fp32 within ``tol`` of the update (the parameters named in
    ``loose``: ``loose_tol``), bf16 one step apart. Returns the largest fp32 difference of the others;
    a failure lists every parameter out of tolerance."""
    errors, apart = {}, {}
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape and g.dtype == r.dtype, (where, name)
        if r.dtype == torch.bfloat16:
            far = int(((g.float() - r.float()).abs() > BF16_STEP * r.float().abs()).sum())
            if far:
                apart[name] = far
            continue
        update = (r - init[name].float()).norm()
        assert update > 0, (where, name)  # every parameter trained
        errors[name] = float((g - r).norm() / update)
    bad = {name: f"{err:.1e}" for name, err in errors.items() if err > (loose_tol if name in loose else tol)}
    assert not bad and not apart, (
        f"{where}: of the update (tolerance {tol:.0e}, {loose_tol:.0e} for {sorted(loose)}): {bad}; "
        f"elements more than one bf16 step apart: {apart}"
    )
    return max((err for name, err in errors.items() if name not in loose), default=0.0)


def check_against_ddp(case, seed, same_data=False, clip_grad=0.0):
    """One case: FSDP2 + ours against DDP + ours, same seed and batches, STEPS steps."""
    name, bf16, split_qkv, moment2_method = case
    world = dist.get_world_size()
    where = (
        f"rank {dist.get_rank()}/{world} {name}{'' if moment2_method is None else f' ({moment2_method})'} "
        f"{'bf16' if bf16 else 'fp32'} split_qkv={split_qkv} clip_grad={clip_grad}"
    )
    init = {n: p.detach().clone() for n, p in megatron_cpu.build_gpt(seed).named_parameters()}  # fp32 init
    ddp = build(megatron_cpu.wrap_in_megatron_ddp, *case, seed, clip_grad)
    train(*ddp, seed, STEPS, same_data)
    fsdp = build(megatron_cpu.wrap_in_torch_fsdp2, *case, seed, clip_grad)
    train(*fsdp, seed, STEPS, same_data)
    if clip_grad:  # the Adam part was clipped, by the same norm on both sides
        for wrapped_optimizer in (ddp[1], fsdp[1]):
            assert wrapped_optimizer.grad_norms_by_part["adamw"] > 10 * clip_grad, where
        assert abs(fsdp[1].grad_norms_by_part["adamw"] / ddp[1].grad_norms_by_part["adamw"] - 1) < 1e-5, where
    check_sharded_path(fsdp[1], split_qkv, moment2_method, world, where)
    (ref, ref_main), (got, got_main) = parameters(ddp[0]), parameters(fsdp[0])
    assert set(got_main) == set(ref_main) and bool(ref_main) == bf16, where
    loose = ()
    if moment2_method in SPANNING_STATISTICS or clip_grad:
        assert not bf16, where  # see STATISTICS_TOL and CLIP_CASES
        muon_params = {id(p) for group in muon_member(fsdp[1]).param_groups for p in group["params"]}
        loose = {name for name, p in fsdp[0].module.named_parameters() if id(p) not in muon_params}
    tol = SPANNING_MATRIX_TOL if moment2_method in SPANNING_STATISTICS or clip_grad else FP32_TOL
    worst = assert_close(got, ref, init, where, tol=tol, loose=loose, loose_tol=STATISTICS_TOL)
    worst = max(worst, assert_close(got_main, ref_main, init, f"{where} main params"))
    if dist.get_rank() == 0:
        print(f"{where}: largest difference {worst:.1e} of an update", flush=True)


def dcp_load_target(wrapped, optimizer):
    """What a job resuming from DCP loads into: the module's and the optimizer's state dicts, the
    optimizer state created first as Megatron does before a load (``init_state_fn``, which
    ``sharded_state_dict(is_loading=True)`` calls).

    DCP fills only the entries of the target, and Megatron's init_state_fn for Adam makes no
    ``step`` (its torch_dist format saves one ``common_step`` beside the state instead); torch
    2.14's AdamW then refuses a state without ``step`` at load_state_dict. So the Adam members get a
    ``step`` entry too, which the load overwrites.
    """
    for member in optimizer.chained_optimizers:
        member.init_state_fn(member.optimizer, member.config)
        if isinstance(member.optimizer, torch.optim.AdamW):
            for state in member.optimizer.state.values():
                state.setdefault("step", torch.zeros((), dtype=torch.float32))
    return {"model": wrapped.module.state_dict(), "optimizer": optimizer.state_dict()}


def state_tensors(optimizer):
    """Every optimizer-state tensor, gathered: {(member, group, param index, key): tensor}."""
    out = {}
    for m, member in enumerate(optimizer.chained_optimizers):
        for g, group in enumerate(member.optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                for key, value in member.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value):
                        out[m, g, i, key] = full(value)
    return out


def check_dcp_resume(case, seed, ckpt_dir):
    """DCP save after step 2, a fresh model and optimizer (another seed) load it, step 3: bitwise
    the uninterrupted run's parameters."""
    import torch.distributed.checkpoint as dcp

    where = f"rank {dist.get_rank()}/{dist.get_world_size()} DCP {case}"
    wrapped, optimizer = build(megatron_cpu.wrap_in_torch_fsdp2, *case, seed)
    train(wrapped, optimizer, seed, STEPS - 1)
    dcp.save({"model": wrapped.module.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=ckpt_dir)
    saved = state_tensors(optimizer)
    train(wrapped, optimizer, seed, 1, first=STEPS - 1)
    uninterrupted = parameters(wrapped)

    resumed, optimizer = build(megatron_cpu.wrap_in_torch_fsdp2, *case, seed + 1)
    before = state_tensors(optimizer)
    target = dcp_load_target(resumed, optimizer)
    dcp.load(target, checkpoint_id=ckpt_dir)
    resumed.load_state_dict(target["model"])  # a no-op under FSDP2, as in Megatron: DCP loaded in place
    with on_cpu():
        optimizer.load_state_dict(target["optimizer"])
    loaded = state_tensors(optimizer)
    assert not before and loaded.keys() == saved.keys(), (where, len(before), sorted(set(loaded) ^ set(saved)))
    for key, value in saved.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), (where, key)
    train(resumed, optimizer, seed, 1, first=STEPS - 1)
    for got, ref in zip(parameters(resumed), uninterrupted):
        assert set(got) == set(ref), where
        for name in ref:
            assert torch.equal(got[name], ref[name]), f"{where} {name}: not the uninterrupted run's"


def check_torch_dist_refused_clearly(seed):
    """megatron-core's torch_dist optimizer checkpoint under FSDP2: a ValueError naming torch_dcp (not
    megatron-core's "Param id 0 does not match any model sharded param")."""
    import pytest

    wrapped, optimizer = build(megatron_cpu.wrap_in_torch_fsdp2, "muon", False, True, None, seed)
    train(wrapped, optimizer, seed, 1)
    with on_cpu(), pytest.raises(ValueError, match="torch_dcp"):
        optimizer.sharded_state_dict(wrapped.module.sharded_state_dict())


@exits_without_teardown
def two_rank_worker(rank, world_size, init_file, ckpt_root, seed):
    from megatron_eopt.integrations import megatron as integration

    with megatron_cpu.megatron_world(rank, world_size, init_file):
        integration.install()
        for i, case in enumerate(CASES):
            check_against_ddp(case, seed + 10 * i)
        for i, case in enumerate(CLIP_CASES):
            check_against_ddp(case, seed + 50 + 10 * i, clip_grad=CLIP_GRAD)
        for i, case in enumerate(CHECKPOINT_CASES):
            check_dcp_resume(case, seed + 100 + 10 * i, os.path.join(ckpt_root, f"case{i}"))
        check_torch_dist_refused_clearly(seed + 200)


@exits_without_teardown
def four_rank_worker(rank, world_size, init_file, seed):
    from megatron_eopt.integrations import megatron as integration

    with megatron_cpu.megatron_world(rank, world_size, init_file):
        integration.install()
        for i, case in enumerate(FOUR_RANK_CASES):
            check_against_ddp(case, seed + 10 * i, same_data=True)
