"""Tensor-parallel optimizer steps over N spawned CPU processes (gloo): the ``tp_*`` workloads of run.py.

Each rank holds Megatron-LM's tensor-parallel shards of a model's hidden matrices (column-parallel
QKV and fc1 sharded along their rows, row-parallel proj and fc2 along their columns, over one TP
group of all ranks) and steps ``TensorParallelMuon`` in each ``tp_mode``:

- ``duplicated``: all-gather the shards, every rank orthogonalizes every matrix;
- ``distributed``: Newton–Schulz on the shards with all-reduced Gram matrices;
- ``layer_sharded``: each matrix gathered onto one home rank, orthogonalized there, shards sent back.

Reported per mode: the median over repeats of the slowest rank's step time, and from
``step_stats()`` the bytes and collectives of the busiest rank and the matrices it orthogonalized
whole. The final parameters of every mode are compared with duplicated mode's.
"""

from __future__ import annotations

import os
import statistics
from types import SimpleNamespace

import torch
import workloads_dist

MODES = ("duplicated", "distributed", "layer_sharded")


def gpt2_124m_tp() -> list[tuple[tuple[int, int], int]]:
    """GPT-2 124M's hidden matrices at a quarter width (d_model 192, 12 layers), with Megatron's
    partition_dim: QKV (576, 192) and fc1 (768, 192) column-parallel (rows sharded), proj (192, 192)
    and fc2 (192, 768) row-parallel (columns sharded)."""
    d = 192
    return [((3 * d, d), 0), ((d, d), 1), ((4 * d, d), 0), ((d, 4 * d), 1)] * 12


WORKLOADS = {
    "tp_gpt2_124m": ("GPT-2 124M hidden matrices at d_model 192, Megatron TP layout (48 matrices)", gpt2_124m_tp),
}


def _rank(rank: int, world: int, init: str, name: str, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from megatron_eopt.optim import TensorParallelMuon

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    layout = WORKLOADS[name][1]()
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) * 0.02 for s, _ in layout]
    grads = [torch.randn(s, generator=gen) for s, _ in layout]
    pg = SimpleNamespace(tp=dist.group.WORLD, expt_tp=dist.group.WORLD)
    results, finals = {}, {}
    for mode in MODES:
        params = []
        for t, g, (_, pd) in zip(full, grads, layout):
            p = torch.nn.Parameter(t.chunk(world, dim=pd)[rank].clone())
            p.partition_dim, p.grad = pd, g.chunk(world, dim=pd)[rank].clone()
            params.append(p)
        opt = TensorParallelMuon(params, lr=0.02, momentum=0.95, weight_decay=0.01, fp32_matmul_prec="highest",
                                 pg_collection=pg, tp_mode=mode)
        opt.step()  # warm-up: state, plan, first-call costs
        times = workloads_dist.slowest_rank_ms(opt, repeats)
        stats = opt.step_stats()
        busiest = torch.tensor([float(stats["bytes_sent"]), float(stats["collectives"]), float(stats["ns_matrices"]),
                                float(stats["ns_flops"])])
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        results[mode] = {"median_ms": statistics.median(times), "samples_ms": times,
                         "bytes_sent_per_rank": int(busiest[0]), "collectives_per_rank": int(busiest[1]),
                         "ns_matrices_per_rank": int(busiest[2]), "ns_gflops_per_rank": float(busiest[3]) / 1e9}
        finals[mode] = [p.detach().clone() for p in params]
    for mode in MODES[1:]:
        diff = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(finals[mode], finals["duplicated"]))
        diff_t = torch.tensor([diff])
        dist.all_reduce(diff_t, op=dist.ReduceOp.MAX)
        results[mode]["rel_diff_vs_duplicated"] = float(diff_t)
    results["duplicated"]["rel_diff_vs_duplicated"] = 0.0
    workloads_dist.finish_rank(rank, out, {"name": name, "ranks": world, "description": WORKLOADS[name][0],
                                           "matrices": len(layout), "results": results})


def run(name: str, ranks: int, quick: bool) -> dict:
    """Spawns `ranks` processes for workload `name`; returns the result of rank 0."""
    return workloads_dist.spawn(_rank, name, ranks, quick)


def markdown(entries: list[dict], environment: dict) -> str:
    """The RESULTS.md section of a tensor-parallel run."""
    cpu = environment["device_name"].split(",")[0]
    lines = [
        f"## Tensor-parallel Muon steps (Megatron TP shards, gloo), {cpu}, {os.cpu_count()} cores (cpu)",
        "",
        workloads_dist.measured(environment, "tp") + " `TensorParallelMuon` in each `tp_mode`. **ms**: median over "
        "repeats of the slowest rank's step. **MiB sent**, **calls**, **NS matrices**, **NS GFLOP**: the busiest rank's, from `step_stats()` "
        "(bytes by the textbook algorithm of each collective). **rel. diff**: final parameters against "
        "duplicated mode.",
        "",
        "| workload | ranks | mode | ms | MiB sent | calls | NS matrices | NS GFLOP | rel. diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        for mode, r in e["results"].items():
            lines.append(
                f"| {e['name']} | {e['ranks']} | {mode} | {r['median_ms']:.1f} | "
                f"{r['bytes_sent_per_rank'] / 2**20:.2f} | {r['collectives_per_rank']} | "
                f"{r['ns_matrices_per_rank']} / {e['matrices']} | {r['ns_gflops_per_rank']:.2f} | "
                f"{r['rel_diff_vs_duplicated']:.1e} |"
            )
    return "\n".join(lines) + "\n"
