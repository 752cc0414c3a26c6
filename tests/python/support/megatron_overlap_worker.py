"""``install(overlap_backward=True)`` under Megatron-LM's DistributedDataParallel, on gloo ranks (CPU).

Each case trains megatron_cpu's GPT twice from the same seed, on rank-dependent tokens (so the
reduction matters), under Megatron DDP with ``overlap_grad_reduce`` and small buckets (several bucket
groups, dispatched during backward): once with the plug's ``overlap_backward`` and once without. The
parameters and the Muon state must be bitwise equal after every step, and from the second step on
(Megatron dispatches nothing during the first batch's backward) every chunk of the Muon optimizers
must have started before ``step()``: in backward, as the bucket groups were reduced.

Cases: the chained optimizer on fp32 parameters (Megatron's FP32Optimizer: the optimizer steps the
model's parameters) and on bf16 ones (Float16OptimizerWithFloat16Params: fp32 main copies), the
layer-wise optimizer (each rank owns whole matrices, its gradients all-reduced or, with Megatron's
layer-wise parameter layout, reduce-scattered), tensor parallelism 2 (the Muon chunks all-gather over
TP: collectives, run on the backward thread in bucket order), and experts over expert parallelism 2
(DDP's expert bucket groups).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import megatron_cpu  # noqa: E402
from megatron_layer_wise_worker import layer_wise_members, on_cpu  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

STEPS = 3
BUCKET_SIZE = 12_000  # elements: the tiny GPT's weights fall into several bucket groups

# case -> (optimizer, bf16, tensor parallel, Megatron wrappers on the CPU)
CASES = {
    "chained_fp32": ("muon", False, 1),
    "chained_bf16": ("muon", True, 1),
    "layer_wise_bf16": ("dist_muon", True, 1),
    "tensor_parallel_bf16": ("muon", True, 2),
    # the layer-wise optimizer with Megatron's layer-wise parameter layout: gradients reduce-scattered,
    # each rank's matrices whole in its shard of the buffer, Adam a DistributedOptimizer
    "layer_wise_reduce_scatter_bf16": ("muon", True, 1),
    # a mixture of experts over expert parallelism 2: the experts' gradients in DDP's expert bucket groups
    "experts_bf16": ("muon", True, 1),
    "bf16_grads_fp32_fc1": ("muon", True, 1),
    # Megatron's default, without overlap_grad_reduce: every group reduces in finish_grad_sync, at the
    # end of backward, where the chunks then start (before step(), with nothing left to overlap)
    "no_overlap_grad_reduce_bf16": ("muon", True, 1),
}
EXPERT_PARALLEL = {"experts_bf16": 2}
# bf16 gradient buffers, fc1's gradients accumulated in fp32 tensors of their own (Megatron's
# param_name_patterns_for_fp32_local_accumulation): Megatron hands both to the optimizer in step()
# only (a copy of the bf16 ones; the fp32 ones copied back from the buffer in finish_grad_sync), so
# no chunk starts in backward, and the step is still the same.
LEFT_TO_STEP = {"bf16_grads_fp32_fc1": ("*linear_fc1*",)}


def build_moe_gpt(seed: int):
    """megatron_cpu's GPT with 4 experts (top-2, the all-gather dispatcher, which runs on the CPU) in
    each layer's MLP, split over the expert-parallel ranks, in bf16."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0, pipeline_dtype=torch.bfloat16,
        bf16=True, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather", add_bias_linear=False,
        expert_model_parallel_size=EXPERT_PARALLEL["experts_bf16"])
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4),
                     vocab_size=megatron_cpu.VOCAB, max_sequence_length=megatron_cpu.SEQ,
                     share_embeddings_and_output_weights=False)
    return model.bfloat16()


def muon_members(optimizer):
    """Our orthogonalizing optimizers inside Megatron's optimizer."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    from megatron_eopt.optim import OrthogonalizedOptimizer

    members = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = layer_wise_members(part) if isinstance(part, LayerWiseDistributedOptimizer) else [part.optimizer]
        members += [m for m in inner if isinstance(m, OrthogonalizedOptimizer)]
    return members


def build(case, overlap, seed, device="cpu"):
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_eopt.integrations import megatron as integration

    name, bf16, _ = CASES[case]
    integration.uninstall()
    integration.install(overlap_backward=overlap)
    model = build_moe_gpt(seed) if case in EXPERT_PARALLEL else megatron_cpu.build_gpt(seed, bf16=bf16)
    model = model.to(device)
    fields = dict(optimizer=name, lr=0.02, min_lr=0.0, weight_decay=0.1, clip_grad=1.0, bf16=bf16, fp16=False,
                  muon_fp32_matmul_prec="highest")
    if bf16:
        fields["params_dtype"] = torch.bfloat16
    config = mcore_optimizer.OptimizerConfig(**fields)
    config.muon_workspace_mib = 0.001  # a chunk per matrix: chunks start one by one as their groups reduce
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=case != "no_overlap_grad_reduce_bf16",
                                               bucket_size=BUCKET_SIZE,
                                               grad_reduce_in_fp32=case not in LEFT_TO_STEP)
    if case in LEFT_TO_STEP:
        ddp_config.param_name_patterns_for_fp32_local_accumulation = LEFT_TO_STEP[case]
    with on_device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "dist_muon" is Megatron's older spelling
        if case == "layer_wise_reduce_scatter_bf16":
            from megatron.training.training import wrap_model_chunks_with_ddp

            config.use_layer_wise_distributed_optimizer = config.use_distributed_optimizer = True
            ddp_config.use_distributed_optimizer = True
            (ddp_model,) = wrap_model_chunks_with_ddp(
                [model], model.config, ddp_config, use_layer_wise_distributed_optimizer=True,
                use_layer_wise_param_layout=True, DP=DistributedDataParallel)
        else:
            ddp_model = DistributedDataParallel(model.config, ddp_config, model)
        if case in EXPERT_PARALLEL:
            assert ddp_model.expert_parallel_bucket_groups, "no expert bucket groups"
        optimizer = mcore_optimizer.get_megatron_optimizer(config, [ddp_model])
    if case == "layer_wise_reduce_scatter_bf16":
        assert [type(o).__name__ for o in optimizer.chained_optimizers] == [
            "LayerWiseDistributedOptimizer", "DistributedOptimizer"], optimizer.chained_optimizers
    members = muon_members(optimizer)
    assert members and all(m.overlap_backward is overlap for m in members), (case, members)
    return ddp_model, optimizer, members


@contextlib.contextmanager
def on_device(device):
    """Megatron's DDP and optimizer wrappers on the CPU (megatron_cpu's patches); on CUDA as they are."""
    if device != "cpu":
        yield
        return
    with megatron_cpu.megatron_ddp_on_cpu(), megatron_cpu.megatron_optimizer_on_cpu(), on_cpu():
        yield


def train_step(ddp_model, optimizer, members, seed, step, overlap, device="cpu", left_to_step=False):
    """Megatron's training step (zero the buffers, two micro-batches' forward / backward, the first
    under ``no_sync()``, finish the grad sync, step), on tokens of this data-parallel rank and step.
    With overlap, from the second step on, every chunk of every Muon member has started by the time
    backward and the grad sync are done."""
    from megatron.core import parallel_state

    g = torch.Generator().manual_seed(seed * 1000 + 10 * step + parallel_state.get_data_parallel_rank())
    batch, seq, vocab = megatron_cpu.BATCH, megatron_cpu.SEQ, megatron_cpu.VOCAB
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1).view(1, 1, seq, seq)
    tokens, labels, position_ids, causal_mask = (t.to(device) for t in (tokens, labels, position_ids, causal_mask))
    with on_device(device):
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        with ddp_model.no_sync():  # a first micro-batch, as Megatron's schedules run it: nothing starts
            ddp_model(tokens.flip(0), position_ids, causal_mask, labels=labels.flip(0)).float().mean().backward()
        for m in members:
            assert not overlap or m._overlap.work is None, "work started on a non-final micro-batch"
        loss = ddp_model(tokens, position_ids, causal_mask, labels=labels).float().mean()
        loss.backward()
        ddp_model.finish_grad_sync()
        if overlap and step > 0 and not left_to_step:
            for m in members:
                work = m._overlap.work
                assert work is not None and len(work.started) == len(m._plan.chunks) > 0, \
                    (step, None if work is None else (len(work.started), len(m._plan.chunks)))
        assert optimizer.step()[0]


def check(case, seed, device="cpu"):
    from megatron.core import parallel_state, tensor_parallel as megatron_tensor_parallel

    tensor_parallel = CASES[case][2]
    if device != "cpu":  # Megatron's own scratch buffer and CUDA RNG tracker
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_parallel, 1)
        megatron_tensor_parallel.model_parallel_cuda_manual_seed(seed)
    elif case in EXPERT_PARALLEL:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=EXPERT_PARALLEL[case])
        megatron_cpu.use_cpu_scratch_and_rng()
    else:
        megatron_cpu.use_model_parallel(tensor_parallel)
    runs = {}
    for overlap in (True, False):
        ddp_model, optimizer, members = build(case, overlap, seed, device)
        chunks = sum(len(m._current_plan().chunks) for m in members)
        for step in range(STEPS):
            train_step(ddp_model, optimizer, members, seed, step, overlap, device, case in LEFT_TO_STEP)
        params = {n: p.detach().clone() for n, p in ddp_model.module.named_parameters()}
        # each member's state, parameter by parameter in param-group order
        states = [[(k, v.clone()) for g in m.param_groups for p in g["params"]
                   for k, v in sorted(m.state[p].items()) if torch.is_tensor(v)] for m in members]
        runs[overlap] = params, states, chunks
    (p1, s1, c1), (p0, s0, c0) = runs[True], runs[False]
    assert c1 == c0 > 1, (case, c1, c0)
    for name in p0:
        assert torch.equal(p1[name], p0[name]), (case, name, (p1[name].float() - p0[name].float()).abs().max())
    assert [[k for k, _ in s] for s in s1] == [[k for k, _ in s] for s in s0] and s0[0], case
    for a, b in zip(s1, s0):
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b)), case
    assert parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel


def _refused(build_optimizer, expected: str, what: str) -> None:
    try:
        build_optimizer()
    except ValueError as exc:
        assert expected in str(exc), str(exc)
    else:
        raise AssertionError(f"overlap_backward accepted {what}")


def check_refusals():
    """Megatron's global clip of Muon's gradients is refused with overlap_backward, and so are fp16's
    loss scaling and a model chunk that is neither Megatron DDP nor torch FSDP2."""
    import megatron.core.optimizer as mcore_optimizer

    from megatron_eopt.integrations import megatron as integration

    megatron_cpu.use_model_parallel(1)
    integration.uninstall()
    integration.install(overlap_backward=True, clip_policy="global")
    model = megatron_cpu.build_gpt(1)
    config = mcore_optimizer.OptimizerConfig(optimizer="muon", lr=0.02, clip_grad=1.0)
    with megatron_cpu.megatron_ddp_on_cpu():
        ddp_model = megatron_cpu.wrap_in_megatron_ddp(model)
        _refused(lambda: mcore_optimizer.get_megatron_optimizer(config, [ddp_model]), "clip_policy 'global'",
                 "Megatron's global clip")
        integration.uninstall()
        integration.install(overlap_backward=True)
        fp16 = mcore_optimizer.OptimizerConfig(optimizer="muon", lr=0.02, clip_grad=0.0, fp16=True,
                                               params_dtype=torch.float16)
        _refused(lambda: mcore_optimizer.get_megatron_optimizer(fp16, [ddp_model]), "fp16", "fp16's loss scaling")
    _refused(lambda: mcore_optimizer.get_megatron_optimizer(config, [model]), "GPTModel",
             "a model chunk without a data-parallel wrapper")
    integration.uninstall()


@exits_without_teardown
def worker(rank, world_size, init_file, seed, cases):
    with megatron_cpu.megatron_world(rank, world_size, init_file):
        for case in cases:
            check(case, seed)
            dist.barrier()
        check_refusals()


@exits_without_teardown
def gpu_worker(rank, world_size, init_file, seed, cases):
    """The cases on CUDA devices over NCCL (one GPU per rank): the bucket groups' NCCL waits issued on
    the optimizer's side stream."""
    import warnings as warning_filters

    from megatron.core import parallel_state

    from megatron_eopt.integrations import megatron as integration

    warning_filters.filterwarnings("ignore")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        for case in cases:
            check(case, seed, "cuda")
            dist.barrier()
    finally:
        integration.uninstall()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
