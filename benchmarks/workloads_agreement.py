"""What the ranks' agreement costs a sharded step, over N spawned CPU processes (gloo): the
``agreement_*`` workloads of run.py.

Every step whose matrices span ranks first agrees between them on everything that changes a
collective or a result (options, param groups, parameters, which have grads: docs/sharded.md
"Ranks that differ"): one all-reduce of five integers per mesh dim, and a digest of the step's
fields on the host. Measured here on FSDP2's layout (``Shard(0)`` DTensors over all ranks) of
GPT-2 124M's hidden matrices at a quarter width, ``Muon`` at its defaults (bf16 products, owner
mode), steps with ``rank_checks="every_step"`` (the default) and ``"construction"`` (agreed when
built only) interleaved, so both see the same load. Reported: the median step of the slowest
rank each way, their ratio, and the agreement alone (host digest + all-reduce, median).
"""

from __future__ import annotations

import statistics
import time

import torch
import workloads_dist

WORKLOADS = {
    "agreement_gpt2_124m": ("GPT-2 124M hidden matrices at d_model 192 (48 matrices), FSDP2 layout, Muon defaults",
                            workloads_dist.gpt2_124m_scaled),
}


def _slowest_ms(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed) * 1e3


def _rank(rank: int, world: int, init: str, name: str, repeats: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatron_eopt.optim import Muon

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = WORKLOADS[name][1]()
    full = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for t in full]
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, [Shard(0)], src_data_rank=None)
    opt = Muon(params, lr=0.02)
    opt.step()  # state, plan, first-call costs
    times = {"every_step": [], "construction": []}
    for _ in range(3 * repeats):
        for checks in times:
            opt.rank_checks = checks
            times[checks].append(_slowest_ms(opt.step))
    opt.rank_checks = "every_step"
    plan = opt._current_plan()
    active = [e.param.grad is not None for e in plan.entries]
    alone = [_slowest_ms(lambda: opt._agree_step(plan, active, None)) for _ in range(3 * repeats)]
    on, off = statistics.median(times["every_step"]), statistics.median(times["construction"])
    workloads_dist.finish_rank(rank, out, {
        "name": name, "ranks": world, "description": WORKLOADS[name][0], "matrices": len(shapes),
        "results": {"step": {"median_ms": on, "without_ms": off, "ratio": on / off,
                             "agreement_ms": statistics.median(alone)}},
    })


def run(name: str, ranks: int, quick: bool) -> dict:
    return workloads_dist.spawn(_rank, name, ranks, quick)


def markdown(entries: list[dict], environment: dict) -> str:
    """The RESULTS.md section of an agreement run."""
    cpu = environment["device_name"].split(",")[0]
    measured = workloads_dist.measured(environment, "agreement").replace('fp32 "highest"', 'bf16 products ("medium")')
    lines = [
        f"## The ranks' agreement before a sharded step (`rank_checks`), {cpu} (cpu)",
        "",
        measured + " FSDP2's layout (`Shard(0)` over all ranks), `Muon(params, lr=0.02)`, owner mode. "
        "**with** / **without**: median of the slowest rank's step with `rank_checks=\"every_step\"` (the default: "
        "options, groups, parameters and grads agreed before the step) and `\"construction\"` (agreed when built "
        "only), interleaved; **agreement ms**: the agreement alone (host digest of the step's fields and one "
        "all-reduce of five integers), median of the slowest rank.",
        "",
        "| workload | ranks | with ms | without ms | with / without | agreement ms |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries:
        r = e["results"]["step"]
        lines.append(f"| {e['name']} | {e['ranks']} | {r['median_ms']:.1f} | {r['without_ms']:.1f} | "
                     f"{r['ratio']:.3f} | {r['agreement_ms']:.2f} |")
    return "\n".join(lines) + "\n"
