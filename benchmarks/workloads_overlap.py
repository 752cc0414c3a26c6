"""Training steps with and without ``overlap_backward`` over N spawned CPU processes (gloo): the
``overlap_*`` workloads of run.py.

Each rank runs forward, backward and ``Muon.step()`` of a 12-block residual model with GPT-2 124M's
hidden matrices at a quarter width (per block: QKV (576, 192), proj (192, 192), fc1 (768, 192), fc2
(192, 768)), in two layouts:

- ``fsdp2``: every block ``fully_shard``-ed over all ranks (FSDP2), owner mode; the hooks fire after
  each block's reduce-scatter and the owner exchanges run inside backward;
- ``replicated``: every rank holds the whole model and steps it alone (no communication); the
  work of each chunk runs on the optimizer's worker thread while backward continues.

Reported per layout, overlap off and on (medians over repeats of the slowest rank): the time from
the end of backward to the end of ``step()`` (the exposed optimizer time), the whole
forward + backward + step, and ``step_stats()``'s NS matrices and bytes of the busiest rank. The
final parameters of overlap on and off are compared: they must be equal (bitwise).
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import workloads_dist

D = 192
LAYERS = 12
TOKENS = 256

WORKLOADS = {
    "overlap_gpt2_124m": (f"12-block residual model, GPT-2 124M hidden matrices at d_model {D}, {TOKENS} tokens "
                          "per rank", None),
}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, bias=False)
        self.proj = torch.nn.Linear(D, D, bias=False)
        self.fc1 = torch.nn.Linear(D, 4 * D, bias=False)
        self.fc2 = torch.nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.proj(torch.tanh(q) * k + v)
        return x + self.fc2(torch.relu(self.fc1(x)))


def _model(seed: int, fsdp_mesh=None) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[_Block() for _ in range(LAYERS)])
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    return model


def _rank(rank: int, world: int, init: str, name: str, repeats: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_eopt.optim import Muon

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for layout in ("fsdp2", "replicated"):
        finals = {}
        for overlap in (False, True):
            model = _model(0, mesh if layout == "fsdp2" else None)
            # the default budget of the CPU (64 MiB) makes this model one chunk: nothing could start
            # before the last gradient; 4 MiB cuts it into a chunk per block or two
            opt = Muon(model.parameters(), lr=0.02, momentum=0.95, weight_decay=0.01, overlap_backward=overlap,
                       workspace_mib=4)
            gen = torch.Generator().manual_seed(1 + rank)
            exposed, whole, held_sizes = [], [], []
            for i in range(repeats + 1):
                x = torch.randn(TOKENS, D, generator=gen)
                dist.barrier()
                start = time.perf_counter()
                model(x).square().mean().backward()
                backward_end = time.perf_counter()
                # waits for the worker as step() would (then step() finds it done): timed as exposed
                held = opt._overlap.held_bytes() if overlap else 0
                opt.step()
                opt.zero_grad()
                end = time.perf_counter()
                t = torch.tensor([end - backward_end, end - start, float(held)])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if i:  # the first step builds state and plans
                    exposed.append(float(t[0]) * 1e3)
                    whole.append(float(t[1]) * 1e3)
                    held_sizes.append(float(t[2]))
            stats = opt.step_stats()
            busiest = torch.tensor([float(stats["bytes_sent"]), float(stats["ns_matrices"]),
                                    float(stats["seconds_before_step"] or 0.0)])
            dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
            results[f"{layout}, overlap {'on' if overlap else 'off'}"] = {
                "exposed_ms": statistics.median(exposed), "median_ms": statistics.median(whole),
                "held_mib": statistics.median(held_sizes) / 2**20,
                "bytes_sent_per_rank": int(busiest[0]), "ns_matrices_per_rank": int(busiest[1]),
                "ms_before_step": float(busiest[2]) * 1e3, "chunks": len(opt._plan.chunks),
            }
            finals[overlap] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                               for p in model.parameters()]
        same = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(finals[False], finals[True])))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        results[f"{layout}, overlap on"]["bitwise_equal"] = bool(same)
    workloads_dist.finish_rank(rank, out, {"name": name, "ranks": world, "description": WORKLOADS[name][0],
                                           "matrices": 4 * LAYERS, "results": results})


def run(name: str, ranks: int, quick: bool) -> dict:
    return workloads_dist.spawn(_rank, name, ranks, quick)


def markdown(entries: list[dict], environment: dict) -> str:
    """The RESULTS.md section of an overlap run."""
    cpu = environment["device_name"].split(",")[0]
    # Muon's default precision here, not the fp32 of the other distributed tables
    measured = workloads_dist.measured(environment, "overlap").replace('fp32 "highest"', 'bf16 products ("medium")')
    lines = [
        f"## Newton–Schulz overlapped with backward (`overlap_backward`), {cpu}, {os.cpu_count()} cores (cpu)",
        "",
        measured + " A training step of a 12-block residual model with "
        "GPT-2 124M's hidden matrices at d_model 192 (`workspace_mib=4`: the step in chunks of a block or two). "
        "**exposed ms**: end of backward to end of `step()`; **step ms**: forward + backward + step; medians of "
        "the slowest rank. **ms before step**: host time of the optimizer work done during backward "
        "(`step_stats()['seconds_before_step']`, busiest rank). fsdp2: FSDP2 shards, owner mode (the work runs "
        "in the hooks, after each reduce-scatter); replicated: the whole model on every rank (the work runs on "
        "the optimizer's worker thread). **held MiB**: what the started chunks hold from backward until `step()` "
        "(their fp32 Newton–Schulz inputs and results, the busiest rank; without overlap nothing is held, and "
        "the step allocates one chunk's buffer, at most `workspace_mib`). **equal**: the final parameters with "
        "and without overlap, bit for bit.",
        "",
        "| workload | ranks | layout, overlap | exposed ms | step ms | ms before step | held MiB | MiB sent "
        "| NS matrices / rank | equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        for mode, r in e["results"].items():
            equal = "" if "bitwise_equal" not in r else ("yes" if r["bitwise_equal"] else "**no**")
            lines.append(
                f"| {e['name']} | {e['ranks']} | {mode} | {r['exposed_ms']:.1f} | {r['median_ms']:.1f} | "
                f"{r['ms_before_step']:.1f} | {r['held_mib']:.1f} | {r['bytes_sent_per_rank'] / 2**20:.2f} | "
                f"{r['ns_matrices_per_rank']} / {e['matrices']} | {equal} |"
            )
    return "\n".join(lines) + "\n"
