"""The planner (megatron_eopt.plan): its model's invariants, the presets, the CLI and its errors.
Its counts against the step's own (step_stats) run on gloo ranks: test_step_stats.py."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_eopt import plan
from megatron_eopt.step_stats import newton_schulz_flops


def _total_flops(matrices, mesh):
    out = 0.0
    for m in matrices:
        batch = m.experts if m.experts else 1
        out += m.count * batch * newton_schulz_flops(*m.shape, plan.NS_STEPS)
    return out


@pytest.mark.parametrize("preset", sorted(plan.PRESETS))
@pytest.mark.parametrize("mesh", [plan.Mesh(1, 8, 1, 1), plan.Mesh(4, 8, 1, 1), plan.Mesh(2, 4, 2, 2)])
def test_every_matrix_is_orthogonalized_once_per_replica_or_once(preset, mesh):
    """owner: the FLOPs of a replica's ranks add up to the model's (every replica repeats them);
    split: the whole mesh's do; gather: every rank holds every matrix."""
    matrices = plan.PRESETS[preset][1]()
    if any(m.experts % mesh.ep for m in matrices if m.experts):
        pytest.skip("experts do not divide")
    total = _total_flops(matrices, mesh)
    replicas = mesh.dp_replicate * (mesh.ep if not any(m.experts for m in matrices) else 1)
    owner = plan.rank_counts(matrices, mesh, "owner")
    split = plan.rank_counts(matrices, mesh, "split")
    assert len(owner) == len(split) == mesh.world
    if not any(m.experts for m in matrices):
        assert math.isclose(sum(r.ns_flops for r in owner), total * replicas, rel_tol=1e-9)
        assert math.isclose(sum(r.ns_flops for r in split), total, rel_tol=1e-9)
    assert max(r.ns_flops for r in split) <= max(r.ns_flops for r in owner)
    gather = plan.rank_counts(matrices, mesh, "gather")[0]
    assert gather.ns_flops >= max(r.ns_flops for r in owner)


def test_estimate_orders_by_time_and_choose_picks_ours():
    matrices = plan.PRESETS["llama3-8b"][1]()
    mesh = plan.Mesh(8, 8, 1, 1)
    estimates = plan.estimate(matrices, mesh, "H100")
    assert [e.seconds for e in estimates] == sorted(e.seconds for e in estimates)
    assert {e.layout for e in estimates} == set(plan.LAYOUTS)
    assert plan.choose(matrices, mesh, "H100") in plan.OURS
    # torchtitan's DistMuon has no tensor parallelism: left out where tp > 1
    assert "torchtitan_dist_muon" not in {e.layout for e in plan.estimate(matrices, plan.Mesh(1, 2, 1, 2))}


def test_a_replica_free_mesh_splits_nothing():
    matrices = [plan.Matrix((64, 32), 6), plan.Matrix((32, 96), 3)]
    mesh = plan.Mesh(1, 4, 1, 1)
    owner = plan.rank_counts(matrices, mesh, "owner", workspace_mib=None)
    split = plan.rank_counts(matrices, mesh, "split", workspace_mib=None)
    assert [(r.ns_flops, r.bytes_sent, r.collectives) for r in owner] == \
        [(r.ns_flops, r.bytes_sent, r.collectives) for r in split]
    assert sum(r.ns_matrices for r in owner) == 9


def test_bad_input_names_it():
    with pytest.raises(ValueError, match="layout"):
        plan.rank_counts([plan.Matrix((4, 4))], plan.Mesh(), "sharded")
    with pytest.raises(ValueError, match="experts"):
        plan.rank_counts([plan.Matrix((4, 4), experts=6)], plan.Mesh(ep=4), "owner")
    with pytest.raises(SystemExit, match="--mesh"):
        plan.main(["--mesh", "dp=2"])


def test_cli_prints_a_table_and_a_choice(capsys):
    assert plan.main(["--preset", "moe-64e", "--gpus", "8", "64"]) == 0
    table = capsys.readouterr().out
    assert table.count("| moe-64e |") == 2 * len(plan.LAYOUTS)  # tp 1: every layout runs
    assert plan.main(["--preset", "llama3-8b", "--mesh", "dp_replicate=2,dp_shard=8"]) == 0
    assert "chosen:" in capsys.readouterr().out


class _FakeMesh:
    def __init__(self, *sizes):
        self.sizes = sizes

    def size(self, dim=None):
        return math.prod(self.sizes) if dim is None else self.sizes[dim]


def _fake_dtensor(shape, mesh, placements):
    from types import SimpleNamespace

    return SimpleNamespace(shape=shape, ndim=len(shape), device_mesh=mesh, placements=placements,
                           device=torch.device("cpu"))


def test_replica_work_auto_weighs_the_saved_newton_schulz_against_the_sent_results():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from megatron_eopt.optim.multirank.hardware import HARDWARE, Hardware
    from megatron_eopt.optim.multirank.replica_work import choose_replica_work, resolve_replica_work

    hsdp = _FakeMesh(4, 8)
    # 64 matrices: 8 per rank of a replica, 2 per rank of the mesh
    pairs = [(_fake_dtensor((4096, 4096), hsdp, (Replicate(), Shard(0))), "error")] * 64
    for name in ("H100", "B200", "CPU"):
        assert choose_replica_work(pairs, "medium", 5, HARDWARE[name]) == "split"
    # a network slow against the device: results sent across nodes cost more than orthogonalizing again
    slow = Hardware("fast GPU, slow network", {"medium": 1e4}, 0.0, 450.0, 0.01, 20.0)
    assert choose_replica_work(pairs, "medium", 5, slow) == "repeat"
    # nothing to share: no replicate dim, a replicated (not sharded) matrix, experts sharded on their dim
    assert choose_replica_work([(_fake_dtensor((64, 64), _FakeMesh(8), (Shard(0),)), "error")], "medium", 5,
                               slow) == "repeat"
    nothing = [(_fake_dtensor((64, 64), hsdp, (Replicate(), Replicate())), "error"),
               (_fake_dtensor((8, 64, 64), hsdp, (Replicate(), Shard(0))), "batch")]
    assert choose_replica_work(nothing, "medium", 5, HARDWARE["H100"]) == "repeat"
    # an expert batch sharded on a matrix dim is shared
    experts = [(_fake_dtensor((64, 64, 64), hsdp, (Replicate(), Shard(1))), "batch")] * 64
    assert choose_replica_work(experts, "medium", 5, HARDWARE["H100"]) == "split"
    # one matrix whose shards are strided (FSDP2 over TP) cannot share its owner: every rank repeats
    strided = pairs + [(_fake_dtensor((64, 64), hsdp, (Replicate(), _StridedShard(0, split_factor=2))), "error")]
    assert choose_replica_work(strided, "medium", 5, HARDWARE["H100"]) == "repeat"
    # ... also where the strided dim has one rank (describe() refuses "split" for it all the same)
    hsdp_tp = _FakeMesh(2, 1, 2)
    strided = [(_fake_dtensor((64, 64), hsdp_tp, (Replicate(), _StridedShard(0, split_factor=2), Shard(0))), "error")]
    assert choose_replica_work(strided, "medium", 5, HARDWARE["H100"]) == "repeat"
    groups = [dict(params=[p for p, _ in pairs])]
    assert resolve_replica_work("auto", "gather", groups, "error", "medium", 5) == "repeat"
    assert resolve_replica_work("repeat", "owner", groups, "error", "medium", 5) == "repeat"
    assert resolve_replica_work("auto", "owner", [dict(params=[torch.zeros(4, 4)])], "error", "medium", 5) == "repeat"


def _as_dtensors(matrices, mesh):
    """The planner's matrices as the optimizer holds them: fake DTensors on a (dp_replicate,
    dp_shard, ep, tp) mesh, dense weights Shard(fsdp_dim) over dp_shard and Shard(tp_dim) over tp
    (Replicate where tp_dim is None), replicated over dp_replicate and ep; expert batches (E, m, n)
    Shard(0) over ep, in nd_mode "batch"."""
    from torch.distributed.tensor import Replicate, Shard

    fake_mesh = _FakeMesh(*mesh.dims)
    pairs = []
    for m in matrices:
        lead = 1 if m.experts else 0
        placements = (Replicate(), Shard(lead + m.fsdp_dim), Shard(0) if m.experts else Replicate(),
                      Replicate() if m.tp_dim is None else Shard(lead + m.tp_dim))
        shape = (m.experts, *m.shape) if m.experts else tuple(m.shape)
        pairs += [(_fake_dtensor(shape, fake_mesh, placements), "batch" if m.experts else "error")] * m.count
    return pairs


def _tp_replicated(matrices):
    """The same model with its first kind of matrix not sharded by tensor parallelism (a replica over tp)."""
    import dataclasses

    return [dataclasses.replace(m, tp_dim=None) if i == 0 else m for i, m in enumerate(matrices)]


def _agreement_cases():
    """Every preset at every world size of the documentation's table (its meshes: TP 8 for 70B, EP 8
    for the MoE from 64 GPUs), and meshes with TP and EP where the table has none."""
    cases = [(preset, plan.default_mesh(preset, gpus), False) for preset in sorted(plan.PRESETS)
             for gpus in (16, 64, 256, 1024)]
    cases += [("llama3-8b", plan.Mesh(gpus // 8, 4, 1, 2), tp_replicated) for gpus in (16, 64, 256)
              for tp_replicated in (False, True)]
    cases += [("llama3-70b", plan.Mesh(gpus // 32, 8, 1, 4), tp_replicated) for gpus in (64, 256)
              for tp_replicated in (False, True)]
    cases += [("moe-64e", plan.Mesh(gpus // 32, 4, 4, 2), tp_replicated) for gpus in (32, 128, 512)
              for tp_replicated in (False, True)]
    return cases


@pytest.mark.parametrize("hardware", ["H100", "B200"])
@pytest.mark.parametrize("preset,mesh,tp_replicated", _agreement_cases())
def test_replica_work_auto_picks_what_the_planner_picks(preset, mesh, tp_replicated, hardware):
    """replica_work="auto" on the optimizer's own matrices (DTensors: the placements FSDP2 / HSDP,
    EP and TP give them) chooses what the planner's step (its workspace chunks included) finds
    cheaper, "repeat" on a tie: one cost model, whatever the preset, the mesh, TP and EP."""
    from megatron_eopt.optim.multirank.hardware import HARDWARE
    from megatron_eopt.optim.multirank.replica_work import choose_replica_work

    matrices = plan.PRESETS[preset][1]()
    if tp_replicated:
        matrices = _tp_replicated(matrices)
    seconds = {e.layout: e.seconds for e in plan.estimate(matrices, mesh, hardware, "medium", ("owner", "split"))}
    planned = "split" if seconds["split"] < seconds["owner"] else "repeat"
    chosen = choose_replica_work(_as_dtensors(matrices, mesh), "medium", plan.NS_STEPS, HARDWARE[hardware])
    assert chosen == planned, (seconds, chosen)
