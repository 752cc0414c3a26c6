"""What the ranks' agreement costs a sharded step, over N spawned CPU processes (gloo): the
``agreement_*`` workloads of run.py.

Every step whose matrices span ranks first agrees between them on everything that changes a
collective or a result (options, param groups, parameters, which have grads: docs/sharded.md
"Ranks that differ"): one all-reduce of five integers per mesh dim, and a digest of the step's
fields on the host. Measured here on FSDP2's layout (``Shard(0)`` DTensors over all ranks) of
GPT-2 124M's hidden matrices at a quarter width, ``Muon`` at its defaults (bf16 products, owner
mode), steps with ``rank_checks="every_step"`` (the default), ``"riding"`` (the agreement in a
header of the step's first exchange) and ``"construction"`` (agreed when built only) interleaved,
one optimizer each and one more without, the settings rotated over the optimizers, so all see the
same load and the same memory. Reported: the median step of the slowest rank each way, their ratios
to the step without, the ratio between the two runs without (the comparison's noise),
the all-reduce agreement alone (host digest + all-reduce, median), its host part for these matrices
and for 560, and riding's copy of the first chunk's momentum.
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


MANY_MATRICES = 560  # a 70B-parameter Llama's hidden matrices (80 layers of 7)


def _host_ms(opt, repeats: int) -> float:
    """The agreement's host part for ``opt``'s step (its fields and their bytes), median ms."""
    from megatron_eopt.optim.multirank.agreement import fields_bytes

    plan = opt._current_plan()
    active = [e.param.grad is not None for e in plan.entries]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fields_bytes(opt._agreement_fields(active, plan))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _first_chunk_copy_ms(opt, plan, repeats: int) -> float:
    """What riding on the step's first exchange adds to every step (docs/sharded.md, "Riding on the
    first exchange"): a copy of the first chunk's momentum on this rank, to put back when the ranks
    differ. Median ms, rank 0."""
    momentum = [opt.state[plan.entries[i].param]["momentum_buffer"].to_local() for i in plan.chunks[0]]
    copies = [torch.empty_like(m) for m in momentum]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch._foreach_copy_(copies, momentum)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


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
    grads = [torch.randn(t.shape, generator=gen) for t in full]
    # One optimizer per setting, over parameters of their own (the same values), the settings rotated
    # over the optimizers in as many phases, so that what differs between the optimizers themselves
    # (where their memory lies) weighs on every setting alike.
    settings = ["every_step", "riding", "construction", "construction again"]
    opts = []
    for _ in settings:
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)) for t in full]
        for p, g in zip(params, grads):
            p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
        opts.append(Muon(params, lr=0.02))
    # Each round: a step with each setting (the ratio of the two runs without is the comparison's
    # own noise: two runs that do the same work). The differences are about 1% of a step: many rounds.
    times: dict[str, list[float]] = {run: [] for run in settings}
    for phase in range(len(settings)):
        by_setting = {run: opts[(i + phase) % len(opts)] for i, run in enumerate(settings)}
        for run, o in by_setting.items():
            o.rank_checks = run.split()[0]
            o.step()  # state, plan, first-call costs; riding: the step after a change makes its ticket
            o.step()
        for r in range(3 * repeats):  # (each round starts with another setting: no setting always follows one)
            for run in settings[r % len(settings):] + settings[:r % len(settings)]:
                times[run].append(_slowest_ms(by_setting[run].step))
    riding_stats = by_setting["riding"].step_stats()
    opt = by_setting["every_step"]
    plan = opt._current_plan()
    active = [e.param.grad is not None for e in plan.entries]
    alone = [_slowest_ms(lambda: opt._agree_step(plan, active, None)) for _ in range(3 * repeats)]
    host = _host_ms(opt, 3 * repeats)
    snapshot = _first_chunk_copy_ms(opt, plan, 3 * repeats)
    many = [torch.nn.Parameter(torch.randn(8, 8, generator=gen)) for _ in range(MANY_MATRICES)]
    for p in many:
        p.grad = torch.randn(8, 8, generator=gen)
    alone_opt = Muon(many, lr=0.02)
    alone_opt.step()
    host_many = _host_ms(alone_opt, 3 * repeats)
    on, off = statistics.median(times["every_step"]), statistics.median(times["construction"])
    ride = statistics.median(times["riding"])
    workloads_dist.finish_rank(rank, out, {
        "name": name, "ranks": world, "description": WORKLOADS[name][0], "matrices": len(shapes),
        "results": {"step": {"median_ms": on, "without_ms": off, "ratio": on / off,
                             "riding_ms": ride, "riding_ratio": ride / off,
                             "riding_agreements": riding_stats["agreements"],
                             "riding_agreement_bytes": riding_stats["agreement_bytes"],
                             "noise_ratio": statistics.median(times["construction again"]) / off,
                             "agreement_ms": statistics.median(alone), "host_ms": host,
                             "host_ms_many": host_many, "first_chunk_copy_ms": snapshot}},
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
        "options, groups, parameters and grads agreed by an all-reduce before the step) and `\"construction\"` "
        "(agreed when built only); **riding**: with `\"riding\"` (the same agreement in a header of the step's "
        "first exchange, with the copy of its first chunk's state); one optimizer per setting and one more "
        "without, steps interleaved (each round starting with the next setting), the settings rotated over the "
        "optimizers in four phases; **noise**: the "
        "ratio between the two runs without, the comparison's own spread; **agreement ms**: the all-reduce agreement alone (host digest "
        "of the step's fields and one all-reduce of five integers), median of the slowest rank; **host ms**: its "
        f"host part (the step's fields and their bytes), rank 0, for these matrices and for {MANY_MATRICES} "
        "(8 x 8, unsharded: the part that grows with the model; riding pays it too); **first chunk copy ms**: "
        "riding's copy of the first chunk's momentum, rank 0.",
        "",
        f"| workload | ranks | with ms | riding ms | without ms | with / without | riding / without | noise | "
        f"agreement ms | host ms | host ms, {MANY_MATRICES} | first chunk copy ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        r = e["results"]["step"]
        lines.append(f"| {e['name']} | {e['ranks']} | {r['median_ms']:.1f} | {r['riding_ms']:.1f} | "
                     f"{r['without_ms']:.1f} | {r['ratio']:.3f} | {r['riding_ratio']:.3f} | {r['noise_ratio']:.3f} | "
                     f"{r['agreement_ms']:.2f} | {r['host_ms']:.3f} | "
                     f"{r['host_ms_many']:.2f} | {r['first_chunk_copy_ms']:.2f} |")
    return "\n".join(lines) + "\n"
