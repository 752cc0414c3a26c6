"""Sharded optimizer steps over N spawned CPU processes (gloo): the ``dist_*`` workloads of run.py.

Each rank holds FSDP2's layout of a model's hidden matrices (DTensor, ``Shard(0)`` over a 1-D
mesh of all ranks) and steps ``megatron_eopt.optim.Muon`` in three ways:

- ``owner``: the default sharded mode, one owner per matrix, shards moved by all-to-all;
- ``gather``: every rank all-gathers every matrix and orthogonalizes all of them (the reference);
- ``replicated``: every rank holds the full tensors and steps all of them with no communication
  (Emerging-Optimizers' behaviour under data parallelism: per-rank redundant computation).

Reported per mode: the median over repeats of the slowest rank's step time, and the bytes each
rank sends per step (owner: counted in the all-to-alls; gather: a ring all-gather sends (P-1)
times the rank's shard of every matrix it gathers; replicated: none). The final parameters of
owner and gather are compared (same start, same grads): they must agree.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time

import torch

MODES = ("owner", "gather", "replicated")


def gpt2_124m_scaled() -> list[tuple[int, ...]]:
    """GPT-2 124M's hidden matrices at a quarter width (d_model 192, 12 layers): 48 matrices."""
    d = 192
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * 12


def qwen3_moe_scaled() -> list[tuple[int, ...]]:
    """A Qwen3-30B-A3B MoE layer at an eighth of its width: q 512x256, k/v 64x256, o 256x512, router
    16x256 and 16 experts as 3-D tensors (16, 96, 256) gate and up, (16, 256, 96) down (nd_mode "batch";
    FSDP2 shards them on the expert dim, so they are orthogonalized where they live)."""
    return [(512, 256), (64, 256), (64, 256), (256, 512), (16, 256), (16, 96, 256), (16, 96, 256), (16, 256, 96)]


WORKLOADS = {
    "dist_gpt2_124m": ("GPT-2 124M hidden matrices at d_model 192 (48 matrices, 7.1 M params)", gpt2_124m_scaled),
    "dist_qwen3_moe": ("Qwen3-30B-A3B MoE layer at 1/8 width (16 experts as 3-D tensors)", qwen3_moe_scaled),
}


def _gather_bytes(p) -> int:
    """Bytes a rank sends in a ring all-gather of the fp32 NS input of p (matrix dims sharded only)."""
    from torch.distributed.tensor import Shard

    nd = p.ndim
    if not any(isinstance(pl, Shard) and pl.dim % nd >= nd - 2 for pl in p.placements) and nd == 3:
        return 0  # experts sharded on dim 0: orthogonalized locally in every mode
    world = p.device_mesh.size()
    return (world - 1) * p.to_local().numel() * 4


def _rank(rank: int, world: int, init: str, name: str, repeats: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron_eopt.optim import Muon

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    shapes = WORKLOADS[name][1]()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    kwargs = dict(lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True, fp32_matmul_prec="highest",
                  nd_mode="batch")
    results, finals = {}, {}
    for mode in MODES:
        if mode == "replicated":
            params = [torch.nn.Parameter(t.clone()) for t in full]
            for p, g in zip(params, grads):
                p.grad = g
            opt = Muon(params, **kwargs)
            sent = 0
        else:
            params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for t in full]
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
            opt = Muon(params, sharded_mode=mode, **kwargs)
            sent = sum(_gather_bytes(p) for p in params) if mode == "gather" else None
        opt.step()  # warm-up: state, plan, first-call costs
        opt._sharded.bytes_sent = 0
        times = slowest_rank_ms(opt, repeats)
        if sent is None:
            sent = opt._sharded.bytes_sent // repeats
        sent_max = torch.tensor([float(sent)])
        dist.all_reduce(sent_max, op=dist.ReduceOp.MAX)
        results[mode] = {"median_ms": statistics.median(times), "samples_ms": times,
                         "bytes_sent_per_rank": int(sent_max)}
        if mode != "replicated":
            finals[mode] = [p.detach().to_local().clone() for p in params]
    diff = max(
        float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(finals["owner"], finals["gather"])
        if b.numel()
    )
    diff_t = torch.tensor([diff])
    dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        numel = sum(math.prod(s) for s in shapes)
        with open(out, "w") as f:
            json.dump({"name": name, "ranks": world, "description": WORKLOADS[name][0], "params": numel,
                       "results": results, "owner_vs_gather_rel_diff": float(diff_t)}, f)
    dist.destroy_process_group()


def slowest_rank_ms(opt, repeats: int) -> list[float]:
    """``repeats`` steps of ``opt``, each timed on every rank: the slowest rank's ms of each (a step
    is as slow as its slowest rank)."""
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed) * 1e3)
    return times


def spawn(rank_fn, name: str, ranks: int, quick: bool) -> dict:
    """Spawns `ranks` processes running ``rank_fn(rank, world, init, name, repeats, out)``; returns
    what rank 0 wrote to ``out`` (JSON)."""
    import torch.multiprocessing as mp

    repeats = 2 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(rank_fn, args=(ranks, os.path.join(tmp, "rendezvous"), name, repeats, out), nprocs=ranks, join=True)
        with open(out) as f:
            return json.load(f)


def run(name: str, ranks: int, quick: bool) -> dict:
    """Spawns `ranks` processes for workload `name`; returns the result of rank 0."""
    return spawn(_rank, name, ranks, quick)


def measured(environment: dict, prefix: str) -> str:
    """The section's first sentences: how and where it was measured."""
    return (f"Measured by `python benchmarks/run.py --workload {prefix}_...`: commit `{environment['git_commit']}`; "
            f"torch {environment['torch']}; date {environment['date_utc']}. One process per rank, 1 thread each "
            f"(more ranks than the {os.cpu_count()} cores share them: a rank's time then includes waiting for a "
            "core), fp32 \"highest\", quintic x5.")


def markdown(entries: list[dict], environment: dict) -> str:
    """The RESULTS.md section of a distributed run."""
    cpu = environment["device_name"].split(",")[0]
    lines = [
        f"## Sharded Muon steps (DTensor Shard(0), gloo), {cpu}, {os.cpu_count()} cores (cpu)",
        "",
        measured(environment, "dist") + " **ms**: median over repeats of the slowest rank's step. **MiB sent**: "
        "bytes each rank sends per step. owner: one owner per matrix, all-to-all; gather: all-gather, every "
        "rank orthogonalizes every matrix; replicated: full tensors on every rank, no communication "
        "(per-rank redundant computation).",
        "",
        "| workload | ranks | owner ms | gather ms | replicated ms | owner MiB sent | gather MiB sent | "
        "gather / owner | replicated / owner | owner vs gather rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        r = e["results"]
        o, g, rep = (r[m]["median_ms"] for m in MODES)
        mib = lambda m: f"{r[m]['bytes_sent_per_rank'] / 2**20:.2f}"  # noqa: E731
        lines.append(
            f"| {e['name']} | {e['ranks']} | {o:.1f} | {g:.1f} | {rep:.1f} | {mib('owner')} | {mib('gather')} | "
            f"{g / o:.2f}x | {rep / o:.2f}x | {e['owner_vs_gather_rel_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"
