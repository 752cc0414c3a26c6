"""One gloo rank of the ``overlap_backward`` tests (spawned by test_overlap_backward.py): an FSDP2
model (the hooks fire after the reduce-scatter; owner mode's exchanges run inside backward),
tensor-parallel shards (layer-sharded and distributed modes' collectives inside backward) and DDP
(the work starts as each bucket is all-reduced), each compared bit for bit with the same optimizer
without overlap."""

from __future__ import annotations

import os
import sys
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelMuon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

STEPS = 3


class _Net(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        # 37 rows: uneven (padded) FSDP2 shards
        self.layers = torch.nn.ModuleList([torch.nn.Linear(24, 37, bias=False), torch.nn.Linear(37, 37, bias=False),
                                           torch.nn.Linear(37, 24, bias=False)])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return x


def _fsdp(mesh, seed):
    from torch.distributed.fsdp import fully_shard

    model = _Net(torch.Generator().manual_seed(seed))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_fsdp(mesh, seed, cls, kwargs, micro):
    """FSDP2 with ``micro`` micro-batches per step (the non-final ones without gradient sync)."""
    results = []
    for overlap in (False, True):
        model = _fsdp(mesh, seed)
        opt = cls(model.parameters(), overlap_backward=overlap, workspace_mib=0.001, **kwargs)
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        for _ in range(STEPS):
            for k in range(micro):
                model.set_requires_gradient_sync(k == micro - 1)
                model(torch.randn(5, 24, generator=gen)).square().mean().backward()
                if k < micro - 1:
                    assert getattr(opt, "_overlap", None) is None or opt._overlap.work is None, "work started on a non-final micro-batch"
            if overlap:
                work = opt._overlap.work
                assert work is not None and len(work.started) == len(opt._plan.chunks), "nothing ran in backward"
            opt.step()
            opt.zero_grad()
        results.append(([p.full_tensor() for p in model.parameters()], opt.step_stats()))
    (want, plain), (got, overlapped) = results
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"FSDP2 {cls.__name__} {kwargs} micro={micro} param {i}: overlap differs"
    assert overlapped["ns_matrices"] == plain["ns_matrices"], (overlapped, plain)
    # the same work; the overlapped step agrees before each chunk whose work communicates, and once
    # more in step(), the plain step once before it (multirank.agreement)
    for key, agreed in (("collectives", "agreements"), ("bytes_sent", "agreement_bytes")):
        assert overlapped[key] - overlapped[agreed] == plain[key] - plain[agreed], (key, overlapped, plain)
    assert plain["agreements"] == 1 and overlapped["agreements"] == len(opt._plan.chunks) + 1, (plain, overlapped)
    assert overlapped["seconds_before_step"] is not None


def check_tensor_parallel(group, seed, tp_mode):
    """Tensor-parallel shards whose gradients come from one backward pass."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(seed)
    shapes = [((32, 16), 0), ((16, 32), 1), ((24, 16), 0), ((12, 12), -1)]
    full = [torch.randn(s, generator=gen) * 0.1 for s, _ in shapes]
    grads = [[torch.randn(s, generator=gen) for s, _ in shapes] for _ in range(STEPS)]

    def shard(t, pd):
        return (t if pd == -1 else t.chunk(size, dim=pd)[rank]).clone()

    results = []
    for overlap in (False, True):
        params = []
        for t, (_, pd) in zip(full, shapes):
            p = torch.nn.Parameter(shard(t, pd))
            p.partition_dim = pd
            params.append(p)
        opt = TensorParallelMuon(params, lr=0.02, pg_collection=SimpleNamespace(tp=group, expt_tp=group),
                                 tp_mode=tp_mode, fp32_matmul_prec="highest", overlap_backward=overlap,
                                 workspace_mib=0.001)
        for step_grads in grads:
            sum((p * shard(g, pd)).sum() for p, g, (_, pd) in zip(params, step_grads, shapes)).backward()
            if overlap:  # every chunk ran in backward, its collectives included
                assert len(opt._overlap.work.started) == len(opt._plan.chunks) > 1
            opt.step()
            opt.zero_grad()
        results.append(params)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"tp_mode={tp_mode} param {i}: overlap differs"


def check_ddp(seed, micro):
    """DDP (gradient_as_bucket_view=True, small buckets): the work starts as each bucket is all-reduced
    (overlap_with_ddp's comm hook), no_sync() micro-batches start nothing; the same bits as plain DDP."""
    from torch.nn.parallel import DistributedDataParallel

    results = []
    for overlap in (False, True):
        model = DistributedDataParallel(_Net(torch.Generator().manual_seed(seed)), gradient_as_bucket_view=True,
                                        bucket_cap_mb=0.004)
        opt = Muon(model.parameters(), lr=0.02, overlap_backward=overlap, workspace_mib=0.001)
        if overlap:
            opt.overlap_with_ddp(model)
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        for _ in range(STEPS):
            for k in range(micro):
                if k < micro - 1:
                    with model.no_sync():
                        model(torch.randn(5, 24, generator=gen)).square().mean().backward()
                    assert not overlap or opt._overlap.work is None, "work started on a no_sync micro-batch"
                else:
                    model(torch.randn(5, 24, generator=gen)).square().mean().backward()
            if overlap:
                opt._overlap.wait()
                assert len(opt._overlap.work.started) == len(opt._plan.chunks), "nothing ran in backward"
            opt.step()
            opt.zero_grad(set_to_none=False)
        results.append([p.detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"DDP micro={micro} param {i}: overlap differs"
    check_ddp_unused(seed)
    check_ddp_without_its_hook(seed)
    plain_ddp = DistributedDataParallel(_Net(torch.Generator().manual_seed(seed)))  # copies grads at the end
    for opt, text in ((Muon(plain_ddp.parameters(), overlap_backward=True), "gradient_as_bucket_view=True"),
                      (Muon(plain_ddp.parameters()), "overlap_backward=True")):
        try:
            opt.overlap_with_ddp(plain_ddp)
        except ValueError as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"overlap_with_ddp accepted without {text}")


class _WithUnused(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.net = _Net(gen)
        self.unused = torch.nn.Linear(24, 24, bias=False)  # in a bucket, never given a gradient
        with torch.no_grad():
            self.unused.weight.copy_(torch.randn(24, 24, generator=gen))

    def forward(self, x):
        return self.net(x)


def check_ddp_unused(seed):
    """find_unused_parameters=True with a parameter that never gets a gradient: its chunk is left to
    step(), nothing raises on the communication thread, the same bits as plain DDP."""
    from torch.nn.parallel import DistributedDataParallel

    results = []
    for overlap in (False, True):
        model = DistributedDataParallel(_WithUnused(torch.Generator().manual_seed(seed)), gradient_as_bucket_view=True,
                                        bucket_cap_mb=0.004, find_unused_parameters=True)
        opt = Muon(model.parameters(), lr=0.02, overlap_backward=overlap, workspace_mib=0.001)
        if overlap:
            opt.overlap_with_ddp(model)
        gen = torch.Generator().manual_seed(seed + dist.get_rank())
        for _ in range(STEPS):
            model(torch.randn(5, 24, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        results.append([p.detach().clone() for p in model.parameters()])
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"DDP with an unused param, param {i}: overlap differs"


def check_ddp_without_its_hook(seed):
    """overlap_backward under DDP without overlap_with_ddp: the hooks see the local gradients, DDP's
    averaging changes them afterwards, and step() refuses on every step (never a silent divergence)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_Net(torch.Generator().manual_seed(seed)), gradient_as_bucket_view=True,
                                    bucket_cap_mb=0.004)
    opt = Muon(model.parameters(), lr=0.02, overlap_backward=True, workspace_mib=0.001)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    for step in range(STEPS):
        model(torch.randn(5, 24, generator=gen)).square().mean().backward()
        try:
            opt.step()
        except RuntimeError as e:
            assert "changed after backward started" in str(e), str(e)
        else:
            raise AssertionError(f"step {step}: DDP's all-reduce after the hooks was not refused")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.zero_grad(set_to_none=False)


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    with gloo_world(rank, world_size, init_file):
        world = init_device_mesh("cpu", (world_size,))
        for micro in (1, 2):
            check_fsdp(world, seed, Muon, {}, micro)
        check_fsdp(world, seed, AdaptiveMuon, dict(lr=0.02, momentum=0.9, weight_decay=0.1, moment2_method="normuon"), 1)
        check_fsdp(world, seed, Muon, dict(sharded_mode="gather"), 1)
        for tp_mode in ("duplicated", "distributed", "layer_sharded"):
            check_tensor_parallel(dist.group.WORLD, seed, tp_mode)
        for micro in (1, 2):
            check_ddp(seed, micro)
