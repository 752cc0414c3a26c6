"""``step_stats()``: what the last step did on this rank (megatron_eopt.step_stats), on every
orthogonalizing optimizer; the multi-rank counts run on gloo ranks (step_stats_worker.py)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.multiprocessing as mp


import step_stats_worker  # noqa: E402
from megatron_eopt.step_stats import newton_schulz_flops  # noqa: E402
from megatron_eopt import optim  # noqa: E402
from megatron_eopt.compat import nanochat, snippet, torch_optim  # noqa: E402

SHAPES = [(16, 8), (16, 8), (8, 24), (5, 7)]


def _params(gen):
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def _grads(params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _flops(shapes, steps=5):
    return sum(newton_schulz_flops(m, n, steps) for m, n in shapes)


def _builders():
    """(name, build(params) -> optimizer): every orthogonalizing optimizer family of the package."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            ("Muon", lambda ps: optim.Muon(ps, lr=0.02)),
            ("AdaptiveMuon", lambda ps: optim.AdaptiveMuon(ps, lr=0.02, momentum=0.95, weight_decay=0.0, moment2_method="normuon")),
            ("TensorParallelMuon", lambda ps: optim.TensorParallelMuon(ps, lr=0.02)),
            ("Muown", lambda ps: optim.Muown(ps, lr=0.02)),
            ("HybridMuon", lambda ps: optim.HybridMuon([dict(params=ps, use_muon=True)], lr=0.02)),
            ("torch.optim.Muon front end", lambda ps: torch_optim.Muon(ps, lr=0.02)),
            ("snippet Muon", lambda ps: snippet.Muon(ps, lr=0.02)),
            ("nanochat MuonAdamW", lambda ps: nanochat.MuonAdamW(
                [dict(kind="muon", params=[p for p in ps if p.shape == s], lr=0.02, momentum=0.95, ns_steps=5,
                      beta2=0.95, weight_decay=0.0) for s in dict.fromkeys(p.shape for p in ps)])),
        ]


@pytest.mark.parametrize("name, build", _builders(), ids=[n for n, _ in _builders()])
def test_counts_every_matrix_once(name, build):
    gen = torch.Generator().manual_seed(0)
    params = _params(gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = build(params)
    before = opt.step_stats()
    assert before["ns_matrices"] == 0 and before["seconds_in_step"] is None
    _grads(params, gen)
    opt.step()
    stats = opt.step_stats()
    assert stats["ns_matrices"] == len(SHAPES), (name, stats)
    assert stats["ns_shared_matrices"] == 0 and stats["collectives"] == 0 and stats["bytes_sent"] == 0
    assert stats["seconds_in_step"] > 0 and stats["seconds_before_step"] is None
    steps = 5
    assert stats["ns_flops"] == pytest.approx(_flops(SHAPES, steps)), name
    _grads(params, gen)
    opt.step()
    assert opt.step_stats()["ns_matrices"] == len(SHAPES)  # the last step's, not a running total


def test_batches_splits_and_a_failed_step():
    """An expert batch of E counts E; a fused QKV projection split into parts counts once, its
    FLOPs the parts'; a step that raises keeps the previous step's figures."""
    gen = torch.Generator().manual_seed(1)
    experts = torch.nn.Parameter(torch.randn(3, 8, 4, generator=gen))
    qkv = torch.nn.Parameter(torch.randn(2 * 8, 6, generator=gen))  # 2 groups of [q, k, v] = [4, 2, 2]
    opt = optim.Muon([dict(params=[experts], nd_mode="batch"), dict(params=[qkv], split_shapes=[4, 2, 2])], lr=0.02)
    _grads([experts, qkv], gen)
    opt.step()
    stats = opt.step_stats()
    assert stats["ns_matrices"] == 3 + 1
    assert stats["ns_flops"] == pytest.approx(3 * newton_schulz_flops(8, 4, 5) + _flops([(8, 6), (4, 6), (4, 6)]))
    opt.param_groups[0]["lr"] = -1.0  # refused before anything runs
    _grads([experts, qkv], gen)
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert opt.step_stats() == stats


def test_nested_steps_count_into_both():
    """HybridMuon steps its Muon side: both report the Muon side's matrices."""
    gen = torch.Generator().manual_seed(2)
    params = _params(gen)
    opt = optim.HybridMuon([dict(params=params[:3], use_muon=True), dict(params=params[3:], use_muon=False)],
                           lr=0.02)
    _grads(params, gen)
    opt.step()
    assert opt.step_stats()["ns_matrices"] == 3
    assert opt._muon.step_stats()["ns_matrices"] == 3


def test_multi_rank_counts(tmp_path):
    """Owner and gather modes of DTensor parameters, tensor-parallel modes, and the legacy DistMuon on
    2 gloo ranks: each matrix orthogonalized where the mode says, bytes by the conventions."""
    mp.spawn(step_stats_worker.worker, args=(2, os.path.join(tmp_path, "rendezvous")), nprocs=2, join=True)


def test_replicas_split_the_work(tmp_path):
    """HSDP on 4 gloo ranks (2 replicas x 2 shards): replica_work="split" orthogonalizes each matrix
    once in the mesh, "repeat" once per replica, with the same parameters."""
    mp.spawn(step_stats_worker.worker, args=(4, os.path.join(tmp_path, "rendezvous")), nprocs=4, join=True)
