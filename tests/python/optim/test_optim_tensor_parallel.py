"""Tensor-parallel modes at TP 2 and TP 4 (gloo, CPU) equal the single-device optimizer (docs/design.md §4.9)."""

import os

import pytest
import torch.multiprocessing as mp

import optim_tp_worker


@pytest.mark.distributed
def test_tensor_parallel_modes_match_single_device_at_tp2_and_tp4(tmp_path, gen):
    # One spawn of 4 ranks runs TP 4 and two TP-2 groups: blockwise / duplicated / distributed x
    # Muon and the three second moments, fp32 and bf16 matmuls, QKV split, expert params; then
    # Megatron's TensorParallelMuon on the same shards.
    seed = gen.initial_seed() % (2**31)
    mp.spawn(optim_tp_worker.worker, args=(4, os.path.join(tmp_path, "rendezvous"), seed), nprocs=4, join=True)


@pytest.mark.distributed
def test_tp_mode_auto_equals_the_mode_it_picks(tmp_path, gen):
    # 2 ranks: auto against duplicated and distributed, bit for bit per parameter; experts duplicated.
    seed = gen.initial_seed() % (2**31)
    mp.spawn(optim_tp_worker.auto_worker, args=(2, os.path.join(tmp_path, "rendezvous"), seed), nprocs=2, join=True)


def test_tp_mode_auto_rule():
    """The cost model's choice (Megatron-LM PR #6664's rule on our hardware profiles): a weight sharded
    along its long side goes distributed where the Gram all-reduces are cheap, along its short side
    duplicated; gloo's latency keeps small matrices duplicated; use_syrk (Gram products halved on
    both sides) can flip it; the seconds are what the choice compares."""
    from megatron_eopt.optim.multirank.hardware import HARDWARE
    from megatron_eopt.optim.multirank.tp_modes import auto_tp_mode, auto_tp_mode_seconds

    h100, cpu = HARDWARE["H100"], HARDWARE["CPU"]
    assert auto_tp_mode(14336, 4096, 8, 5, False, 2, h100, "medium") == "distributed"
    assert auto_tp_mode(4096, 14336, 8, 5, False, 2, h100, "medium") == "duplicated"
    assert auto_tp_mode(32, 16, 2, 5, False, 4, cpu, "highest") == "duplicated"
    assert auto_tp_mode(8192, 1024, 2, 5, False, 2, h100, "medium") == "distributed"
    assert auto_tp_mode(8192, 1024, 2, 5, True, 2, h100, "medium") == "duplicated"
    assert auto_tp_mode(14336, 4096, 8, 5, False, 2, h100, "medium", candidates=("duplicated",)) == "duplicated"
    seconds = auto_tp_mode_seconds(14336, 4096, 8, 5, False, 2, h100, "medium")
    assert seconds["distributed"] < seconds["duplicated"]
    # fewer ranks: a larger shard for distributed to orthogonalize
    fewer = auto_tp_mode_seconds(14336, 4096, 4, 5, False, 2, h100, "medium")
    assert fewer["distributed"] > seconds["distributed"]
