"""Megatron-LM training steps with and without ``install(overlap_backward=True)`` over N spawned CPU
processes (gloo): the ``overlap_megatron_*`` workloads of run.py.

Each rank trains megatron-core's GPTModel (local layer spec, bf16 parameters with Megatron's fp32 main
copies) under Megatron's DistributedDataParallel with ``overlap_grad_reduce`` and buckets of about a
layer, its optimizer from ``get_megatron_optimizer(OptimizerConfig(optimizer="muon", bf16=True))``
after megatron-eopt's ``install()``: once without overlap, once with ``overlap_backward`` (each Muon
chunk's momentum and Newton–Schulz start as its bucket group's all-reduce finishes, during backward).
Megatron's CPU patches are the tests' (tests/python/support/megatron_cpu.py).

Reported per mode (medians over repeats of the slowest rank; the first two steps are not timed:
Megatron dispatches no reduction during the first batch's backward): the time from the end of
backward and the grad sync to the end of ``step()`` (the exposed optimizer time), the whole step,
the host time of the optimizer work done during backward, what the started chunks hold until
``step()``, and whether the final parameters of both modes are bitwise equal.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import typing

import torch
import workloads_dist

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(os.path.dirname(HERE), "tests", "python", "support")  # megatron_cpu: Megatron on CPUs

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 6, 256, 4, 1024, 1024, 128, 2

WORKLOADS = {
    "overlap_megatron_gpt": (f"megatron-core GPTModel, {LAYERS} layers, hidden {HIDDEN}, FFN {FFN}, {SEQ} tokens x "
                             f"{BATCH} per rank, bf16, Megatron DDP with overlap_grad_reduce", None),
}


def _megatron_imports():
    if SUPPORT not in sys.path:
        sys.path.insert(0, SUPPORT)
    if not hasattr(typing, "override"):  # Megatron / Emerging-Optimizers import it (Python >= 3.12)
        import typing_extensions

        typing.override = typing_extensions.override
    import megatron_cpu

    return megatron_cpu


def _gpt(seed: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
                               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                               pipeline_dtype=torch.bfloat16, bf16=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, share_embeddings_and_output_weights=False)
    return model.bfloat16()


def _members(optimizer):
    from megatron_eopt.optim import OrthogonalizedOptimizer

    return [part.optimizer for part in optimizer.chained_optimizers
            if isinstance(getattr(part, "optimizer", None), OrthogonalizedOptimizer)]


def _rank(rank: int, world: int, init: str, name: str, repeats: int, out: str) -> None:
    import contextlib
    import warnings

    import megatron.core.optimizer as mcore_optimizer
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_eopt.integrations import megatron as integration

    megatron_cpu = _megatron_imports()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    megatron_cpu.use_model_parallel(1)

    def on_cpu():
        stack = contextlib.ExitStack()
        for patch in (megatron_cpu.megatron_ddp_on_cpu(), megatron_cpu.megatron_optimizer_on_cpu(),
                      megatron_cpu.mixed_precision_wrapper_on_cpu()):
            stack.enter_context(patch)
        return stack

    results, finals = {}, {}
    for overlap in (False, True):
        integration.uninstall()
        integration.install(overlap_backward=overlap)
        model = _gpt(0)
        config = mcore_optimizer.OptimizerConfig(optimizer="muon", lr=0.02, min_lr=0.0, weight_decay=0.1,
                                                 clip_grad=1.0, bf16=True, params_dtype=torch.bfloat16)
        config.muon_workspace_mib = 4  # chunks of a layer or so, which can start while backward goes on
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True,
                                                   bucket_size=4 * HIDDEN * FFN)
        with on_cpu():
            ddp = DistributedDataParallel(model.config, ddp_config, model)
            optimizer = mcore_optimizer.get_megatron_optimizer(config, [ddp])
        members = _members(optimizer)
        gen = torch.Generator().manual_seed(1 + rank)
        position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
        exposed, whole, held_sizes = [], [], []
        for i in range(repeats + 2):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            with on_cpu():
                dist.barrier()
                start = time.perf_counter()
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                ddp(tokens, position_ids, mask, labels=tokens.roll(-1, 1)).float().mean().backward()
                ddp.finish_grad_sync()
                backward_end = time.perf_counter()
                # waits for the worker as step() would (then step() finds it done): timed as exposed
                held = sum(m._overlap.held_bytes() for m in members) if overlap else 0
                assert optimizer.step()[0]
                end = time.perf_counter()
            t = torch.tensor([end - backward_end, end - start, float(held)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= 2:  # the first batch overlaps nothing (Megatron learns the gradients' order), then warm-up
                exposed.append(float(t[0]) * 1e3)
                whole.append(float(t[1]) * 1e3)
                held_sizes.append(float(t[2]))
        busiest = torch.tensor([float(sum(m.step_stats()["ns_matrices"] for m in members)),
                                float(sum(m.step_stats()["seconds_before_step"] or 0.0 for m in members))])
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        results[f"megatron ddp, overlap {'on' if overlap else 'off'}"] = {
            "exposed_ms": statistics.median(exposed), "median_ms": statistics.median(whole),
            "held_mib": statistics.median(held_sizes) / 2**20, "bytes_sent_per_rank": 0,
            "ns_matrices_per_rank": int(busiest[0]), "ms_before_step": float(busiest[1]) * 1e3,
            "chunks": sum(len(m._plan.chunks) for m in members),
        }
        finals[overlap] = [p.detach().clone() for p in model.parameters()]
        matrices = sum(len(g["params"]) for m in members for g in m.param_groups)
    integration.uninstall()
    same = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(finals[False], finals[True])))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    results["megatron ddp, overlap on"]["bitwise_equal"] = bool(same)
    workloads_dist.finish_rank(rank, out, {"name": name, "ranks": world, "description": WORKLOADS[name][0],
                                           "matrices": matrices, "results": results})


def run(name: str, ranks: int, quick: bool) -> dict:
    return workloads_dist.spawn(_rank, name, ranks, quick)


def markdown(entries: list[dict], environment: dict) -> str:
    """The RESULTS.md section of a Megatron overlap run."""
    import workloads_overlap

    cpu = environment["device_name"].split(",")[0]
    measured = workloads_dist.measured(environment, "overlap_megatron").replace('fp32 "highest"',
                                                                             'bf16 products ("medium")')
    lines = [
        f"## Newton–Schulz overlapped with backward under Megatron DDP (`install(overlap_backward=True)`), {cpu}, "
        f"{os.cpu_count()} cores (cpu)",
        "",
        measured + f" megatron-core's GPTModel ({LAYERS} layers, hidden {HIDDEN}, FFN {FFN}, {SEQ} tokens x {BATCH} "
        "per rank, bf16 with fp32 main copies) under Megatron's DistributedDataParallel (`overlap_grad_reduce`, "
        "buckets of about a layer), `get_megatron_optimizer(optimizer=\"muon\")` with `muon_workspace_mib=4`. "
        "**exposed ms**: end of backward and grad sync to end of `step()`; **step ms**: the whole step; "
        "medians of the slowest rank over the steps after the second. **ms before step**: host time of the "
        "Muon work done during backward. **held MiB**: what the started chunks hold until `step()`. **equal**: "
        "the final parameters with and without overlap, bit for bit.",
        "",
    ]
    table = workloads_overlap.markdown(entries, environment).split("\n")
    lines += [line for line in table if line.startswith("|")]
    return "\n".join(lines) + "\n"
