"""``overlap_backward=True`` with several chunks of matrices sharded across ranks: whatever order
their gradients arrive in, the overlapped step is bitwise the plain step, and every rank does the
plain step's share of the work (each matrix's owner is decided from the plan, step.balance, not
from the order the chunks start; step.engine runs both steps). The ranks: overlap_order_worker.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

import overlap_order_worker  # noqa: E402
from megatron_eopt.optim.multirank.owner_exchange import ns_flops  # noqa: E402
from megatron_eopt.optim.step.balance import chunk_start_loads  # noqa: E402


def test_sharded_chunks_in_every_order_on_gloo_ranks(tmp_path):
    mp.spawn(overlap_order_worker.worker, args=(3, os.path.join(tmp_path, "rendezvous"), 0, "cpu"), nprocs=3,
             join=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL ranks)")
def test_sharded_chunks_in_every_order_on_cuda_ranks(tmp_path):
    world = min(3, torch.cuda.device_count())
    mp.spawn(overlap_order_worker.worker, args=(world, os.path.join(tmp_path, "rendezvous"), 0, "cuda"),
             nprocs=world, join=True)


def _fake_plan(shapes, chunks, tp=None):
    """A plan of matrices sharded over 2 ranks in owner mode (one route), and with ``tp`` a
    layer-sharded stack of (12, 8) shards over 2 ranks (entries after the sharded ones)."""
    route = SimpleNamespace(key=("route",), size=2)
    entries = [SimpleNamespace(spans_ranks=True, group_index=0, stack_index=-1, batch=1,
                               sharding=SimpleNamespace(kind="owner", route=route, view_shape=s, region=((0, 0), s)))
               for s in shapes]
    stacks = []
    if tp is not None:
        stacks.append(SimpleNamespace(tp=tp, home=None, global_shape=(24, 8)))
        entries += [SimpleNamespace(spans_ranks=False, group_index=0, stack_index=0, batch=1) for _ in range(3)]
    return SimpleNamespace(entries=entries, stacks=stacks, sharded=list(range(len(shapes))), configs=(object(),),
                           chunks=chunks)


def test_each_chunk_starts_from_the_loads_of_the_chunks_before_it_in_plan_order():
    shapes = [(40, 24), (24, 56), (33, 17), (64, 32), (16, 48), (48, 40)]
    chunks = ((0, 1), (2,), (3, 4, 5))
    plan = _fake_plan(shapes, chunks)
    starts = chunk_start_loads(plan, chunks)
    assert starts[0] == {}
    costs = [ns_flops(s) for s in shapes]
    for k in range(1, len(chunks)):  # every matrix of the chunks before it charged once, to one owner
        (load,) = starts[k].values()
        assert sum(load) == pytest.approx(sum(costs[i] for c in chunks[:k] for i in c))
        assert max(load) - min(load) <= max(costs)
    assert chunk_start_loads(plan, chunks) is starts  # kept while the chunks stay
    other = ((3, 4, 5), (2,), (0, 1))  # another cut: other loads, from that plan order
    assert chunk_start_loads(plan, other) is not starts
    assert sum(chunk_start_loads(plan, other)[1][("route",)]) == pytest.approx(sum(costs[i] for i in (3, 4, 5)))
    assert chunk_start_loads(_fake_plan([], ((),)), ((),)) is None  # nothing spans ranks: nothing balanced


def test_layer_sharded_homes_start_from_the_plan_too():
    tp = SimpleNamespace(mode="layer_sharded", key=("tp",), size=2, ns_batch_size=1)
    chunks = ((0,), (1, 2), (3,))
    plan = _fake_plan([(40, 24)], chunks, tp)
    starts = chunk_start_loads(plan, chunks)
    assert starts[1] == {("route",): [ns_flops((40, 24)), 0.0]}
    assert starts[2][("tp",)] == [ns_flops((24, 8))] * 2  # the stack's two matrices of chunk 1, one per home


def test_homes_over_gtp_x_tp_start_from_the_plan_too():
    # a (6, 8) piece per rank of (12, 8) matrices split over 2 TP ranks, replicated over 2 GTP ranks
    home = SimpleNamespace(key=("homes",), size=4, partition_dim=0, gtp_pad=None, gtp_size=2, tp_size=2,
                           ns_batch_size=1)
    entries = [SimpleNamespace(spans_ranks=False, group_index=0, stack_index=0, batch=1) for _ in range(6)]
    plan = SimpleNamespace(entries=entries, stacks=[SimpleNamespace(tp=None, home=home, local_shape=(6, 8))],
                           sharded=[], configs=(object(),))
    chunks = ((0, 1, 2), (3, 4), (5,))
    starts = chunk_start_loads(plan, chunks)
    cost = ns_flops((12, 8))
    assert starts[0] == {} and starts[1] == {("homes",): [cost] * 3 + [0.0]}
    assert starts[2] == {("homes",): [2 * cost] + [cost] * 3}  # the fourth home first, then the lowest

