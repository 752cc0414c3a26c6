"""One rank of the chunk-order tests of ``overlap_backward`` (spawned by test_overlap_chunk_order.py):
matrices sharded across the ranks (DTensor placements, FSDP2's fully_shard) and tensor-parallel
layer-sharded stacks, stepped in several chunks whose gradients arrive in permuted orders. Every
order must give the plain step's bits, and each rank the plain step's share of the work: the same
owners (Newton–Schulz FLOPs and matrices per rank, bytes sent), whichever chunk started first."""

from __future__ import annotations

import contextlib
import os
import random
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelMuon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

STEPS = 2
# Costs unlike one another (the owners' balance depends on them), uneven shards (33 rows over 2 or 3
# ranks), both matrix dims sharded, and replicated matrices (local stacks: the worker thread on the CPU).
SHAPES = [((40, 24), Shard(0)), ((24, 56), Shard(1)), ((33, 17), Shard(0)), ((20, 20), Replicate()),
          ((64, 32), Shard(0)), ((16, 48), Shard(1)), ((20, 20), Replicate()), ((48, 40), Shard(1))]
ONE_MATRIX_MIB = 0.001  # every matrix a chunk of its own
FEW_MATRICES_MIB = 0.04  # two or three matrices a chunk: several owners per exchange
OPTIMIZERS = {
    "Muon": lambda params, **kw: Muon(params, lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest", **kw),
    "NorMuon": lambda params, **kw: AdaptiveMuon(params, lr=0.02, momentum=0.9, weight_decay=0.1,
                                                 moment2_method="normuon", fp32_matmul_prec="highest", **kw),
    "Muon bf16 state": lambda params, **kw: Muon(params, lr=0.02, state_dtype="bf16", fp32_matmul_prec="highest",
                                                 **kw),
}
# What must be the same on each rank with and without overlap (the agreements aside).
WORK = ("ns_matrices", "ns_flops")


def _orders(n: int, seed: int) -> list[list[int]]:
    """Plan order, its reverse (backward's usual order) and three shuffles, alike on every rank."""
    shuffle = random.Random(seed)
    orders = [list(range(n)), list(reversed(range(n)))]
    for _ in range(3):
        order = list(range(n))
        shuffle.shuffle(order)
        orders.append(order)
    return orders


def _expected_starts(chunks, order: list[int]) -> list[int]:
    """The chunks in the order they start when the params' gradients are final in ``order``."""
    left = [len(c) for c in chunks]
    chunk_of = {i: c for c, chunk in enumerate(chunks) for i in chunk}
    starts = []
    for i in order:
        left[chunk_of[i]] -= 1
        if left[chunk_of[i]] == 0:
            starts.append(chunk_of[i])
    return starts


def _compare(name, plain, overlapped):
    """The params bit for bit and this rank's share of the work."""
    (want, plain_stats), (got, stats) = plain, overlapped
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name}: param {i} differs from the plain step"
    for key in WORK:
        assert stats[key] == plain_stats[key], f"{name}: {key} {stats[key]} != {plain_stats[key]} (other owners)"
    for key, agreed in (("collectives", "agreements"), ("bytes_sent", "agreement_bytes")):
        assert stats[key] - stats[agreed] == plain_stats[key] - plain_stats[agreed], (name, key, stats, plain_stats)


def check_dtensor(mesh, seed, device, name, budget):
    """DTensor params, one backward per param in each order (each param's hook fires at its own
    backward): the chunks start in that order, and every order gives the plain step's bits."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(shape, generator=gen) * 0.1 for shape, _ in SHAPES]
    grads = [[torch.randn(shape, generator=gen) for shape, _ in SHAPES] for _ in range(STEPS)]
    local_grads = [[distribute_tensor(g.to(device), mesh, [pl]).to_local() for g, (_, pl) in zip(step, SHAPES)]
                   for step in grads]

    def run(overlap, order):
        params = [torch.nn.Parameter(distribute_tensor(t.to(device), mesh, [pl])) for t, (_, pl) in zip(full, SHAPES)]
        opt = OPTIMIZERS[name](params, overlap_backward=overlap, workspace_mib=budget)
        chunks = opt._plan.chunks
        assert len(chunks) > 2 and sum(any(opt._plan.entries[i].spans_ranks for i in c) for c in chunks) > 1, chunks
        for step in range(STEPS):
            for i in order:
                (params[i].to_local() * local_grads[step][i]).sum().backward()
            if overlap:
                work = opt._overlap.work
                assert list(work.started) == _expected_starts(chunks, order), (list(work.started), order)
            opt.step()
            opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return [p.full_tensor().cpu() for p in params], opt.step_stats()

    orders = _orders(len(SHAPES), seed)
    plain = run(False, orders[0])
    for order in orders:
        _compare(f"DTensor {name} workspace_mib={budget} order {order}", plain, run(True, order))


class _Block(torch.nn.Module):
    def __init__(self, width, hidden, gen):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class _Net(torch.nn.Module):
    """Residual blocks of unlike widths, applied in ``order``: backward finalizes them in reverse."""

    def __init__(self, gen, order):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(24, h, gen) for h in (37, 16, 50, 29)])
        self.order = order

    def forward(self, x):
        for k in self.order:
            x = self.blocks[k](x)
        return x


def check_fsdp(mesh, seed, device, order):
    """FSDP2 (fully_shard per block): the hooks fire after each block's reduce-scatter, in reverse
    order of use; blocks used in ``order``, each overlapped step equal to the plain one."""
    from torch.distributed.fsdp import fully_shard

    results = []
    for overlap in (False, True):
        model = _Net(torch.Generator().manual_seed(seed), order).to(device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = Muon(model.parameters(), lr=0.02, fp32_matmul_prec="highest", overlap_backward=overlap,
                   workspace_mib=ONE_MATRIX_MIB)
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        for _ in range(STEPS):
            model(torch.randn(5, 24, generator=gen).to(device)).square().mean().backward()
            if overlap:
                assert len(opt._overlap.work.started) == len(opt._plan.chunks) > 2, "nothing ran in backward"
            opt.step()
            opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        results.append(([p.full_tensor().cpu() for p in model.parameters()], opt.step_stats()))
    _compare(f"FSDP2 blocks used in order {order}", *results)


def check_layer_sharded(group, seed, device):
    """Tensor parallel's layer-sharded homes (balanced like the owners) with the gradients of its
    stacks arriving in each order."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(seed)
    shapes = [((12 * size, 16), 0), ((16, 8 * size), 1), ((18 * size, 16), 0), ((10 * size, 10), 0), ((12, 12), -1)]
    full = [torch.randn(s, generator=gen) * 0.1 for s, _ in shapes]
    grads = [[torch.randn(s, generator=gen) for s, _ in shapes] for _ in range(STEPS)]

    def shard(t, pd):
        return (t if pd == -1 else t.chunk(size, dim=pd)[rank]).clone().to(device)

    def run(overlap, order):
        params = []
        for t, (_, pd) in zip(full, shapes):
            p = torch.nn.Parameter(shard(t, pd))
            p.partition_dim = pd
            params.append(p)
        opt = TensorParallelMuon(params, lr=0.02, pg_collection=SimpleNamespace(tp=group, expt_tp=group),
                                 tp_mode="layer_sharded", fp32_matmul_prec="highest", overlap_backward=overlap,
                                 workspace_mib=ONE_MATRIX_MIB)
        for step_grads in grads:
            for i in order:
                (params[i] * shard(step_grads[i], shapes[i][1])).sum().backward()
            if overlap:
                assert list(opt._overlap.work.started) == _expected_starts(opt._plan.chunks, order)
            opt.step()
            opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return [p.detach().cpu() for p in params], opt.step_stats()

    orders = _orders(len(shapes), seed + 1)
    plain = run(False, orders[0])
    for order in orders:
        _compare(f"layer_sharded order {order}", plain, run(True, order))


@contextlib.contextmanager
def _nccl_world(rank, world_size, init_file):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        dist.destroy_process_group()


@exits_without_teardown
def worker(rank, world_size, init_file, seed, device_type):
    world = gloo_world if device_type == "cpu" else _nccl_world
    with world(rank, world_size, init_file):
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        mesh = init_device_mesh(device_type, (world_size,))
        for name in OPTIMIZERS:
            check_dtensor(mesh, seed, device, name, ONE_MATRIX_MIB)
        check_dtensor(mesh, seed, device, "Muon", FEW_MATRICES_MIB)
        for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
            check_fsdp(mesh, seed, device, order)
        check_layer_sharded(dist.group.WORLD, seed, device)
