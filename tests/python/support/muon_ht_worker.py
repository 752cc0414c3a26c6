"""One rank of the TensorParallelMuonHT tests (spawned by test_muon_ht.py, gloo on CPU).

Every rank builds the same full weights (on the sphere of radius R) and gradients, keeps its shards,
steps TensorParallelMuonHT on them and compares the gathered result with the single-process
MuonHyperball stepping the full matrices: equal only if every norm is the whole matrix's.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import MuonHyperball, TensorParallelMuonHT  # noqa: E402
from dist_harness import computing_as_the_ranks, counted_collectives, gloo_world  # noqa: E402
from optim_helpers import tp_gtp_piece  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

RADIUS = 2.0
STEPS = 3
# (global shape, partition_dim, expert, GTP-sharded with pad_length)
LAYOUT = [
    ((32, 16), 0, False, None),
    ((16, 40), 1, False, None),
    ((24, 16), -1, False, None),  # replicated over TP (e.g. an MLA down-projection): no reduction
    ((16, 32), 0, True, None),  # an expert weight: expt_tp
    ((20, 16), 1, False, 4),  # TP-sharded columns, GTP-sharded rows padded by 4 (24 rows, 12 per GTP rank)
]


def _assemble(local, pd, pad, tp_group, gtp_group):
    """The full matrix from every rank's shard (the test's own gathers, outside the optimizer)."""
    x = local.detach()
    if pad is not None and gtp_group is not None:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(gtp_group))]
        dist.all_gather(parts, x.contiguous(), group=gtp_group)
        x = torch.cat(parts)[: x.shape[0] * len(parts) - pad]
    if pd != -1 and tp_group is not None:
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, x.contiguous(), group=tp_group)
        x = torch.cat(parts, dim=pd)
    return x


def check(tp_group, gtp_group, tp_mode, seed):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape, generator=gen) for shape, *_ in LAYOUT]
    full = [w * (RADIUS / w.norm()) for w in full]
    grads = [[torch.randn(shape, generator=gen) for shape, *_ in LAYOUT] for _ in range(STEPS)]
    tp = (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    gtp = (0, 1) if gtp_group is None else (dist.get_rank(gtp_group), dist.get_world_size(gtp_group))
    pg = SimpleNamespace(tp=tp_group, expt_tp=tp_group, gtp_remat=gtp_group, expt_gtp_remat=gtp_group)

    params = []
    for w, (_, pd, expert, pad) in zip(full, LAYOUT):
        p = torch.nn.Parameter(tp_gtp_piece(w, pd, pad if gtp_group is not None else None, tp, gtp))
        p.partition_dim, p.expert_tp = pd, expert
        p.tensor_model_parallel = pd != -1
        if pad is not None and gtp_group is not None:
            p.is_gtp_weight_remat, p.pad_length = True, pad
        params.append(p)
    opt = TensorParallelMuonHT(params, lr=0.05, pg_collection=pg, tp_mode=tp_mode, hyperball_radius=RADIUS,
                               fp32_matmul_prec="highest")
    reduces = []
    for step_grads in grads:
        for p, g, (_, pd, _, pad) in zip(params, step_grads, LAYOUT):
            p.grad = tp_gtp_piece(g, pd, pad if gtp_group is not None else None, tp, gtp)
        with counted_collectives(["all_reduce"]) as calls:
            opt.step()
        reduces.append(calls["all_reduce"])

    ref = [torch.nn.Parameter(w.clone()) for w in full]
    with computing_as_the_ranks():
        ref_opt = MuonHyperball(ref, lr=0.05, hyperball_radius=RADIUS, weight_decay=0.0, nesterov=True, ns_eps=1e-7,
                                fp32_matmul_prec="highest")
        for step_grads in grads:
            for p, g in zip(ref, step_grads):
                p.grad = g.clone()
            ref_opt.step()
    for i, (p, r, (_, pd, _, pad)) in enumerate(zip(params, ref, LAYOUT)):
        got = _assemble(p, pd, pad, tp_group, gtp_group)
        err = (got - r.detach()).abs().max().item()
        assert err <= 1e-6, f"{tp_mode} param {i} {LAYOUT[i]}: max |ours - single-process| = {err}"
        assert abs(got.norm().item() - RADIUS) <= 1e-5 * RADIUS, f"{tp_mode} param {i}: norm {got.norm().item()}"
    return reduces


def check_refusals(tp_group):
    p = torch.nn.Parameter(torch.randn(8, 8))
    p.partition_dim, p.tensor_model_parallel = 0, True
    pg = SimpleNamespace(tp=None, expt_tp=tp_group, gtp_remat=None, expt_gtp_remat=None)
    for kwargs, words in ((dict(pg_collection=pg), "pg_collection.tp"),
                          (dict(pg_collection=SimpleNamespace(tp=tp_group), weight_decay=0.01), "weight_decay"),
                          (dict(pg_collection=SimpleNamespace(tp=tp_group), hyperball_radius=None), "hyperball_radius")):
        kwargs.setdefault("hyperball_radius", RADIUS)
        before = p.detach().clone()
        try:
            TensorParallelMuonHT([p], **kwargs)
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"no error for {kwargs}")
        assert torch.equal(p.detach(), before)
    # Megatron's muon_hyperball (per-shard norms) under a TP group of two ranks: refused, pointing to muon_ht
    from megatron_eopt import registry

    config = SimpleNamespace(lr=0.1, weight_decay=0.0, muon_hyperball_radius=RADIUS)
    try:
        registry.get("muon_hyperball").config_to_kwargs(config, [], SimpleNamespace(tp=tp_group))
    except ValueError as e:
        assert "muon_ht" in str(e) and "tp" in str(e), str(e)
    else:
        raise AssertionError("muon_hyperball built under a TP group of two ranks")
    assert registry.get("muon_hyperball").config_to_kwargs(config, [], SimpleNamespace(tp=None))["hyperball_radius"] == RADIUS


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        world = dist.group.WORLD
        for mode in ("duplicated", "distributed", "layer_sharded", "auto"):
            reduces = check(world, None, mode, seed)
            # the hyperball's norms: one all-reduce of the update norms and one of the weight norms per
            # group of parameters sharing their groups, per bucket (NS collectives aside in distributed mode)
            if mode in ("duplicated", "layer_sharded"):
                assert all(r >= 2 for r in reduces), reduces
        singles = [dist.new_group([r]) for r in range(world_size)]
        check(singles[rank], world, "duplicated", seed + 1)  # GTP 2 x TP 1: the rows' norms over GTP
        check_refusals(world)
