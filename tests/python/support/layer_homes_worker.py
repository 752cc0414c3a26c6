"""One rank of the layer-sharded homes tests (spawned by test_layer_homes.py, gloo on CPU, GTP 2 x TP 2).

Every rank builds the same full weights and gradients and keeps its pieces: TP shards along
``partition_dim`` (-1: replicated over TP), then, for GTP-sharded weights, the TP-local rows padded
by ``pad_length`` and split over GTP. TensorParallelMuon with tp_mode "layer_sharded" must equal the
single-process optimizer on the full matrices and orthogonalize every matrix once in the domain
(step_stats' ns_matrices summed over the 4 ranks), where duplicated mode orthogonalizes each on every rank.
With a group of the whole domain in the pg_collection (PR #6683's ``tp_gtp_remat``, its ranks listed in
another order than the domain's), the homes exchange over it: the same bits, half the all-to-alls.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import TensorParallelAdaptiveMuon, TensorParallelMuon  # noqa: E402
from dist_harness import computing_as_the_ranks, counted_collectives, gloo_world  # noqa: E402
from reference import TOLERANCE, rel_err  # noqa: E402
from optim_helpers import tp_gtp_piece  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

STEPS = 2
# (global shape, partition_dim, GTP pad_length or None: not GTP-sharded)
LAYOUT = [
    ((32, 16), 0, 0),  # TP rows, GTP rows without padding
    ((16, 40), 1, 4),  # TP columns, GTP rows padded by 4 (20 rows, 10 per GTP rank)
    ((24, 16), 0, 4),  # TP rows (12 each), GTP-padded to 16 (8 per GTP rank)
    ((24, 16), -1, None),  # replicated over TP and GTP: an MLA down-projection, a router
    ((20, 12), -1, 4),  # replicated over TP, GTP rows padded by 4
    ((32, 16), 0, None),  # TP rows only: the TP group's own homes, as before
]


def _gather(x, group, dim):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _full(local, pd, pad, tp_group, gtp_group):
    x = local.detach()
    if pad is not None:
        x = _gather(x, gtp_group, 0)
        x = x[: x.shape[0] - pad]
    return x if pd == -1 else _gather(x, tp_group, pd)


def _tagged_pieces(full, tp, gtp, layout=LAYOUT):
    """This rank's pieces of the full weights, tagged as Megatron tags them (partition_dim, GTP rows)."""
    params = []
    for w, (_, pd, pad) in zip(full, layout):
        p = torch.nn.Parameter(tp_gtp_piece(w, pd, pad, tp, gtp))
        p.partition_dim = pd
        if pad is not None:
            p.is_gtp_weight_remat, p.pad_length = True, pad
        params.append(p)
    return params


def check(tp_group, gtp_group, cls, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape, generator=gen) * 0.1 for shape, *_ in LAYOUT]
    grads = [[torch.randn(shape, generator=gen) for shape, *_ in LAYOUT] for _ in range(STEPS)]
    tp = (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    gtp = (dist.get_rank(gtp_group), dist.get_world_size(gtp_group))
    pg = SimpleNamespace(tp=tp_group, expt_tp=tp_group, gtp_remat=gtp_group, expt_gtp_remat=gtp_group)
    results = {}
    for mode in ("layer_sharded", "duplicated"):
        params = _tagged_pieces(full, tp, gtp)
        opt = cls(params, lr=0.05, pg_collection=pg, tp_mode=mode, fp32_matmul_prec="highest", **extra)
        matrices = []
        for step_grads in grads:
            for p, g, (_, pd, pad) in zip(params, step_grads, LAYOUT):
                p.grad = tp_gtp_piece(g, pd, pad, tp, gtp)
            opt.step()
            matrices.append(opt.step_stats()["ns_matrices"])
        results[mode] = ([_full(p, pd, pad, tp_group, gtp_group) for p, (_, pd, pad) in zip(params, LAYOUT)],
                         matrices, opt.tp_modes())
    ref = [torch.nn.Parameter(w.clone()) for w in full]
    with computing_as_the_ranks():
        ref_opt = cls(ref, lr=0.05, fp32_matmul_prec="highest", **extra)
        for step_grads in grads:
            for p, g in zip(ref, step_grads):
                p.grad = g.clone()
            ref_opt.step()
    what = f"{cls.__name__} {extra}"
    for mode, (got, _, _) in results.items():
        for i, (g, r, w) in enumerate(zip(got, ref, full)):
            where = f"{what} {mode} param {i} {LAYOUT[i]}"
            if cls is TensorParallelMuon:  # the same Newton–Schulz of the same matrix
                err = (g - r.detach()).abs().max().item()
                assert err <= 1e-6, f"{where}: max |ours - single-process| = {err}"
            else:  # AdaMuon divides by the root of its second moment, elementwise: the updates' relative error
                err = rel_err(g - w, r.detach() - w)
                assert err <= TOLERANCE["highest"], f"{where}: relative error of the update {err}"
    # Newton–Schulz calls: layer_sharded once per matrix over the 4 ranks, duplicated once per matrix per rank.
    for step in range(STEPS):
        homed = torch.tensor([results["layer_sharded"][1][step]])
        dist.all_reduce(homed)
        assert int(homed) == len(LAYOUT), f"{what}: {int(homed)} Newton–Schulz matrices over the ranks, not {len(LAYOUT)}"
        assert results["duplicated"][1][step] == len(LAYOUT)
    assert set(results["layer_sharded"][2].values()) == {"layer_sharded"}, results["layer_sharded"][2]


def check_combined_group(tp_group, gtp_group, combined, seed):
    """layer_sharded homes relayed over TP then GTP, and over the domain's own group: the same bits,
    and half the all-to-alls (one each way per chunk over the group, two over the relay)."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape, generator=gen) * 0.1 for shape, *_ in LAYOUT]
    grads = [[torch.randn(shape, generator=gen) for shape, *_ in LAYOUT] for _ in range(STEPS)]
    tp = (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    gtp = (dist.get_rank(gtp_group), dist.get_world_size(gtp_group))
    runs = {}
    for name, group in (("relay", None), ("combined", combined)):
        pg = SimpleNamespace(tp=tp_group, expt_tp=tp_group, gtp_remat=gtp_group, expt_gtp_remat=gtp_group,
                             tp_gtp_remat=group, expt_tp_gtp_remat=group)
        params = _tagged_pieces(full, tp, gtp)
        opt = TensorParallelMuon(params, lr=0.05, pg_collection=pg, tp_mode="layer_sharded",
                                 fp32_matmul_prec="highest")
        with counted_collectives(["all_to_all_single"]) as calls:
            for step_grads in grads:
                for p, g, (_, pd, pad) in zip(params, step_grads, LAYOUT):
                    p.grad = tp_gtp_piece(g, pd, pad, tp, gtp)
                opt.step()
        runs[name] = [p.detach().clone() for p in params], calls["all_to_all_single"]
    (relay, relay_calls), (ours, combined_calls) = runs["relay"], runs["combined"]
    for i, (a, b) in enumerate(zip(relay, ours)):
        assert torch.equal(a, b), f"param {i} {LAYOUT[i]}: the combined group's result differs from the relay's"
    # every exchange here spans the GTP x TP domain (the TP-only matrix has its own homes in its TP group, one
    # all-to-all either way): seen 24 against 48
    assert 0 < combined_calls <= relay_calls // 2, (combined_calls, relay_calls)
    # a group that is not the domain (here the TP group) is refused, naming it, on every rank
    wrong = SimpleNamespace(tp=tp_group, expt_tp=tp_group, gtp_remat=gtp_group, expt_gtp_remat=gtp_group,
                            tp_gtp_remat=tp_group, expt_tp_gtp_remat=tp_group)
    try:
        TensorParallelMuon(_tagged_pieces(full[:1], tp, gtp, LAYOUT[:1]), lr=0.05, pg_collection=wrong,
                           tp_mode="layer_sharded")
    except ValueError as exc:
        assert "pg_collection.tp_gtp_remat" in str(exc), str(exc)
    else:
        raise AssertionError("a tp_gtp_remat group other than the TP x GTP domain was accepted")


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        tp_pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        gtp_pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        tp_group, gtp_group = tp_pairs[rank // 2], gtp_pairs[rank % 2]
        check(tp_group, gtp_group, TensorParallelMuon, {}, seed)
        check(tp_group, gtp_group, TensorParallelMuon, dict(ns_batch_size=2), seed + 1)
        check(tp_group, gtp_group, TensorParallelAdaptiveMuon, dict(moment2_method="adamuon"), seed + 2)
        check_combined_group(tp_group, gtp_group, dist.new_group([3, 1, 0, 2]), seed + 3)
