"""Sharded optimizer steps over N spawned CPU processes (gloo): the ``dist_*`` workloads of run.py.

Each rank holds FSDP2's layout of a model's hidden matrices (DTensor, ``Shard(0)`` over a 1-D
mesh of all ranks; ``*_hsdp``: HSDP's, ``(Replicate, Shard(0))`` over 2 replicas x ranks / 2) and
steps ``megatron_eopt.optim.Muon`` in each way:

- ``owner``: the default sharded mode, one owner per matrix (per replica), shards moved by all-to-all;
- ``split`` (HSDP): ``replica_work="split"``, one owner per matrix in the whole mesh;
- ``gather``: every rank all-gathers every matrix and orthogonalizes all of them (the reference);
- ``replicated``: every rank holds the full tensors and steps all of them with no communication
  (Emerging-Optimizers' behaviour under data parallelism: per-rank redundant computation).

Reported per mode: the median over repeats of the slowest rank's step time, and from
``step_stats()`` the busiest rank's bytes sent and matrices orthogonalized. The final parameters of
every mode are compared with gather mode's (same start, same grads): they must agree.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import sys
import time

import torch

MODES = ("owner", "gather", "replicated")
HSDP_MODES = ("owner", "split", "gather", "replicated")


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
    "dist_gpt2_124m_hsdp": ("GPT-2 124M hidden matrices at d_model 192, HSDP: 2 replicas x ranks / 2 shards",
                            gpt2_124m_scaled),
}


def _placements(mesh) -> list:
    """FSDP2's layout: Shard(0) over the shard dim, replicated over HSDP's replicate dim."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]


def _rank(rank: int, world: int, init: str, name: str, repeats: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from megatron_eopt.optim import Muon

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    hsdp = name.endswith("_hsdp")
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,))
    modes = HSDP_MODES if hsdp else MODES
    shapes = WORKLOADS[name][1]()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    kwargs = dict(lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True, fp32_matmul_prec="highest",
                  nd_mode="batch")
    results, finals = {}, {}
    for mode in modes:
        if mode == "replicated":
            params = [torch.nn.Parameter(t.clone()) for t in full]
            for p, g in zip(params, grads):
                p.grad = g
            opt = Muon(params, **kwargs)
        else:
            placements = _placements(mesh)
            params = [torch.nn.Parameter(distribute_tensor(t, mesh, placements, src_data_rank=None)) for t in full]
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g, mesh, placements, src_data_rank=None)
            opt = Muon(params, sharded_mode="gather" if mode == "gather" else "owner",
                       replica_work="split" if mode == "split" else "repeat", **kwargs)
        opt.step()  # warm-up: state, plan, first-call costs
        times = slowest_rank_ms(opt, repeats)
        stats = opt.step_stats()
        busiest = torch.tensor([float(stats["bytes_sent"]), float(stats["ns_matrices"])])
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        results[mode] = {"median_ms": statistics.median(times), "samples_ms": times,
                         "bytes_sent_per_rank": int(busiest[0]), "ns_matrices_per_rank": int(busiest[1])}
        finals[mode] = [p.detach().to_local().clone() if hasattr(p, "to_local") else None for p in params]
    for mode in modes:
        diff = 0.0
        if mode != "replicated":
            diff = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                       for a, b in zip(finals[mode], finals["gather"]) if b.numel())
        diff_t = torch.tensor([diff])
        dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
        results[mode]["rel_diff_vs_gather"] = float(diff_t)
    finish_rank(rank, out, {"name": name, "ranks": world, "description": WORKLOADS[name][0],
                            "params": sum(math.prod(s) for s in shapes),
                            "matrices": sum(math.prod(s[:-2]) for s in shapes), "results": results})


def finish_rank(rank: int, out: str, entry: dict) -> None:
    """A spawned rank's end: rank 0 writes the workload's ``entry`` (JSON) to ``out``, and the process
    leaves without the interpreter's teardown, where gloo's threads now and then abort it ("terminate
    called without an active exception") after everything was measured."""
    if rank == 0:
        with open(out, "w") as f:
            json.dump(entry, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
        f"## Sharded Muon steps (DTensor, FSDP2 and HSDP layouts, gloo), {cpu}, {os.cpu_count()} cores (cpu)",
        "",
        measured(environment, "dist") + " **ms**: median over repeats of the slowest rank's step. **MiB sent**, "
        "**NS matrices**: the busiest rank's, from `step_stats()`. owner: one owner per matrix and replica "
        "(`replica_work=\"repeat\"`), all-to-all; split: one owner per matrix in the whole mesh "
        "(`replica_work=\"split\"`); gather: every rank all-gathers and orthogonalizes every matrix; "
        "replicated: full tensors on every rank, no communication (per-rank redundant computation). "
        "**rel. diff**: final parameters against gather mode.",
        "",
        "| workload | ranks | mode | ms | vs owner | MiB sent | NS matrices / rank | rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        owner_ms = e["results"]["owner"]["median_ms"]
        for mode, r in e["results"].items():
            lines.append(
                f"| {e['name']} | {e['ranks']} | {mode} | {r['median_ms']:.1f} | {r['median_ms'] / owner_ms:.2f}x | "
                f"{r['bytes_sent_per_rank'] / 2**20:.2f} | {r['ns_matrices_per_rank']} / {e['matrices']} | "
                f"{r['rel_diff_vs_gather']:.1e} |"
            )
    return "\n".join(lines) + "\n"
