"""MuonBP, ``Muon(block_period=P)``: shard-local Newton–Schulz on P - 1 of every P steps, a full
Muon step on the P-th (step.block_periodic). The sharded cases run on 2 gloo ranks
(block_periodic_worker.py)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp


import block_periodic_worker  # noqa: E402
from megatron_eopt.optim import Muon  # noqa: E402


def test_sharded_matrices_over_two_ranks(tmp_path):
    mp.spawn(block_periodic_worker.worker, args=(2, os.path.join(tmp_path, "rendezvous"), 0), nprocs=2, join=True)


def test_unsharded_matrices_are_muon_and_the_phase_is_saved():
    gen = torch.Generator().manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(12, 8, generator=gen)) for _ in range(2)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_a, opt_b = Muon(a, lr=0.02, block_period=2), Muon(b, lr=0.02)
    for _ in range(3):
        grads = [torch.randn(12, 8, generator=gen) for _ in a]
        for ps, opt in ((a, opt_a), (b, opt_b)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert opt_a.state_dict()["block_period_steps"] == 3 and "block_period_steps" not in opt_b.state_dict()


@pytest.mark.parametrize("kwargs, name", [(dict(block_period=0), "block_period"), (dict(block_period=1.5), "block_period"),
                                          (dict(block_period=2, block_lr_scale=0.0), "block_lr_scale")])
def test_bad_values(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)
