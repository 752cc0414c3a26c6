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
