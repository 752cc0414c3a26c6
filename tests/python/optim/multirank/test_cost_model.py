"""The cost model (megatron_eopt.optim.multirank.cost_model): the FLOP formula's options, the link a
group's mesh stride spans, and the owner step counted by hand on a small mesh. That replica_work
"auto" and the planner agree through it: tests/python/test_plan.py; tp_mode "auto":
optim/test_optim_tensor_parallel.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_eopt.optim.multirank import cost_model
from megatron_eopt.optim.multirank.cost_model import MeshShape, Placed, group_span, mesh_shape_of, owner_step
from megatron_eopt.optim.multirank.hardware import HARDWARE
from megatron_eopt.step_stats import newton_schulz_flops


def _megatron_count(gram: int, other: int, steps: int, syrk: bool) -> int:
    """Megatron-LM #6664's count per iteration: g (a²b + a³) + 2 a²b, g = 1 with a symmetric kernel."""
    g = 1 if syrk else 2
    return steps * (g * (gram * gram * other + gram ** 3) + 2 * gram * gram * other)


@pytest.mark.parametrize("m,n", [(7, 13), (13, 7), (12, 12), (1, 5)])
def test_one_flop_formula_for_every_gram_side(m, n):
    short, long = min(m, n), max(m, n)
    assert newton_schulz_flops(m, n, 3) == _megatron_count(short, long, 3, False)
    assert newton_schulz_flops(m, n, 3, symmetric_gram=True) == _megatron_count(short, long, 3, True)
    # a shard iterated jointly forms its whole dim's Gram matrix, the longer one too
    assert newton_schulz_flops(m, n, 3, gram_dim=1) == _megatron_count(n, m, 3, False)
    assert newton_schulz_flops(m, n, 3, gram_dim=0, symmetric_gram=True) == _megatron_count(m, n, 3, True)
    with pytest.raises(ValueError, match="gram_dim"):
        newton_schulz_flops(m, n, 3, gram_dim=2)


def test_a_groups_link_is_chosen_by_the_ranks_it_spans():
    h100 = HARDWARE["H100"]
    mesh = MeshShape((4, 8, 1, 8))  # dp_replicate x dp_shard x ep x tp, tp innermost
    assert mesh.strides == (64, 8, 8, 1)
    assert (mesh.span((3,)), mesh.span((1,)), mesh.span((1, 3)), mesh.span((2,))) == (8, 64, 64, 1)
    assert cost_model.link_gbps(h100, mesh.span((3,))) == h100.nvlink_gbps
    assert cost_model.link_gbps(h100, mesh.span((1,))) == h100.network_gbps
    nbytes = 3e6
    assert cost_model.collective_seconds(h100, nbytes, 64) == pytest.approx(
        h100.latency_us * 1e-6 + nbytes / (h100.network_gbps * 1e9))
    # a mesh sliced out of a larger one: its strides are its ranks' distances, not its own sizes'
    world = torch.arange(32).view(2, 4, 4)
    sliced = SimpleNamespace(mesh=world[:, :, 1], size=lambda i: world[:, :, 1].shape[i])
    shape = mesh_shape_of(sliced, 2)
    assert shape.strides == (16, 4) and shape.span((1,)) == 16
    assert mesh_shape_of(SimpleNamespace(size=lambda i: (2, 4)[i]), 2) == MeshShape((2, 4), (4, 1))
    # a process group's ranks give the same span (tp_mode "auto" reads its group so)
    assert group_span([1, 5, 9, 13]) == shape.span((1,)) and group_span([3]) == 1
    # ... which can turn tp_mode "auto" from distributed (its Gram all-reduces on NVLink) to duplicated
    assert cost_model.auto_tp_mode(8192, 1024, 2, 5, False, 2, h100, "medium") == "distributed"
    assert cost_model.auto_tp_mode(8192, 1024, 2, 5, False, 2, h100, "medium", span=16) == "duplicated"


def test_owner_step_by_hand():
    """2 replicas x 2 shards, one (4, 6) matrix Shard(0) over the shards and two replicated (5, 5):
    "repeat" orthogonalizes it once per replica, each shard's 2 x 6 fp32 (48 bytes) going to the
    owner and back; "split" once in the mesh, the owner's replica sending it one shard and the owner
    returning the three others (144 bytes). The replicated matrices stay where they lie."""
    hw = HARDWARE["CPU"]
    mesh = MeshShape((2, 2))
    entries = [Placed((5, 5)), Placed((4, 6), ((1, 0),), (0,)), Placed((5, 5))]
    local = 2 * newton_schulz_flops(5, 5, 5)
    ns = newton_schulz_flops(4, 6, 5)
    repeat = owner_step(entries, mesh, False, hw, "medium", 5)
    assert [(r.ns_matrices, r.ns_flops) for r in repeat] == [(3, local + ns), (2, local), (3, local + ns), (2, local)]
    assert [(r.bytes_sent, r.collectives) for r in repeat] == [(48, 2), (48, 2), (48, 2), (48, 2)]
    split = owner_step(entries, mesh, True, hw, "medium", 5)
    assert [(r.ns_matrices, r.bytes_sent, r.collectives) for r in split] == [(3, 144, 2), (2, 48, 2), (2, 0, 2),
                                                                              (2, 0, 2)]
    # the seconds: the model's primitives, added per rank
    owner = split[0]
    assert owner.compute_s == pytest.approx(2 * cost_model.newton_schulz_seconds(hw, local / 2, "medium")
                                            + cost_model.newton_schulz_seconds(hw, ns, "medium"))
    assert owner.comm_s == pytest.approx(2 * hw.latency_us * 1e-6 + 144 / (hw.nvlink_gbps * 1e9))
    assert cost_model.busiest_seconds(split) == cost_model.seconds_of(owner)
    assert math.isclose(sum(r.ns_flops for r in split), 4 * local + ns)
