"""Builds and trains a small Megatron-LM GPTModel on a CPU-only machine, for the factory tests.

The model is megatron-core's own GPTModel with the local (non-Transformer-Engine) layer spec,
tensor/pipeline parallel size 1 over a one-rank gloo group. Megatron-LM allocates a few
scratch tensors with device="cuda" (attention scratch buffer, default causal mask, the
loss-scale / grad-norm scalars of its optimizer wrappers); the helpers below redirect exactly
those to the CPU and change nothing else. Dropout is off and gradient clipping must stay off
(clip_grad=0): Megatron's clipping asserts CUDA tensors.
"""

from __future__ import annotations

import contextlib
import os
import socket
import types

import torch

VOCAB = 128
SEQ = 16
BATCH = 2


def megatron_optimizer_module():
    """``megatron.core.optimizer``, or None when megatron-core is not installed (only a missing
    megatron-core gives None; a broken one raises, so its tests fail rather than skip)."""
    try:
        import megatron.core.optimizer as module
    except ModuleNotFoundError as exc:
        if exc.name not in ("megatron", "megatron.core"):
            raise
        return None
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _CpuScratchBuffer:
    """Megatron's GlobalMemoryBuffer, allocating on the CPU."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(tuple(shape), dtype=dtype)


def init_megatron_single_rank() -> None:
    """One-rank gloo process group and Megatron's model-parallel state with TP = PP = 1."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    use_cpu_scratch_and_rng()


def use_cpu_scratch_and_rng() -> None:
    """Megatron's scratch buffer on the CPU and its no-op RNG tracker (after initialize_model_parallel)."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state._GLOBAL_MEMORY_BUFFER = _CpuScratchBuffer()
    # The no-op ("inference") RNG tracker: the CUDA one cannot seed without a GPU; dropout is 0.
    tensor_parallel.get_cuda_rng_tracker(inference_rng_tracker=True)


def use_model_parallel(tensor_parallel: int) -> None:
    """Megatron's model-parallel state at TP = ``tensor_parallel`` (PP = 1), replacing any earlier one,
    with its CPU scratch buffer and RNG tracker."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_parallel, 1)
    use_cpu_scratch_and_rng()


@contextlib.contextmanager
def megatron_world(rank: int, world_size: int, init_file: str, tensor_parallel: int = 1):
    """A distributed Megatron worker's world: warnings off, the gloo group of ``dist_harness.gloo_world``
    and Megatron's model-parallel state at TP = ``tensor_parallel`` on the CPU. On the way out our
    Megatron plug is uninstalled and both are torn down."""
    import warnings

    from megatron.core import parallel_state

    from dist_harness import gloo_world
    from megatron_eopt.integrations import megatron as integration

    warnings.filterwarnings("ignore")
    with gloo_world(rank, world_size, init_file):
        try:
            use_model_parallel(tensor_parallel)
            yield
        finally:
            integration.uninstall()
            parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def single_rank_megatron():
    """A one-rank Megatron world (TP = PP = 1, gloo) for the block; on the way out our plug is
    uninstalled and the world torn down."""
    from megatron_eopt.integrations import megatron as integration

    init_megatron_single_rank()
    try:
        yield
    finally:
        integration.uninstall()
        shutdown_megatron()


def on_single_rank(check, *args) -> None:
    """Runs ``check(*args)`` in single_rank_megatron()."""
    with single_rank_megatron():
        check(*args)


def shutdown_megatron() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def build_gpt(seed: int, bf16: bool = False):
    """A 2-layer GPT: hidden 64, 4 heads in 2 query groups (GQA), untied output layer.

    ``bf16=True``: parameters in bfloat16, as Megatron's mixed-precision training keeps them
    (its optimizer wrapper then holds fp32 main copies).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        use_cpu_initialization=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
    )
    return model.bfloat16() if bf16 else model


def forward_backward(model, seed: int) -> float:
    """One language-model loss on random tokens; leaves .grad (and Megatron's .main_grad)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    causal_mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, causal_mask, labels=labels).float().mean()
    loss.backward()
    for p in model.parameters():
        p.main_grad = p.grad  # what Megatron's DDP wrapper provides
    return float(loss.detach())


@contextlib.contextmanager
def megatron_ddp_on_cpu():
    """Lets Megatron's DistributedDataParallel and DistributedOptimizer run on the CPU.

    DDP allocates its parameter / gradient buffers on torch.cuda.current_device() and, before each
    gradient reduction, takes torch.cuda.current_stream() to wait on the CUDA-graph events of
    parameters (there are none without CUDA graphs). The DistributedOptimizer's
    ``fully_reshardable`` checkpoint gathers its state shards with ``tensor.cuda()`` before the
    (NCCL) collective and ``.cpu()`` after. Here the device is the CPU, the stream a None that is
    never used, and ``.cuda()`` leaves a tensor where it is (the gloo collective takes CPU tensors).
    """
    saved = torch.cuda.current_device, torch.cuda.current_stream, torch.Tensor.cuda
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.current_stream = lambda *args, **kwargs: None
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.cuda.current_device, torch.cuda.current_stream, torch.Tensor.cuda = saved


def wrap_in_megatron_ddp(model):
    """Megatron's DistributedDataParallel around ``model`` (default config: fp32 grads, no overlap)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with megatron_ddp_on_cpu():
        return DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)


def wrap_in_torch_fsdp2(model):
    """megatron-core's TorchFullyShardedDataParallel around ``model`` (PyTorch FSDP2: ``fully_shard`` on
    every TransformerLayer, the embedding and the root; every parameter becomes a ``Shard(0)`` DTensor
    over the data-parallel group), on the CPU.

    Two things differ from a GPU run, nothing else: the wrapper builds its mesh with
    ``DeviceMesh.from_group(group, "cuda")``, made "cpu" here (the group is gloo); and the model's
    config says ``transformer_impl="local"`` (build_gpt's layer spec is the local one, the config's
    default names Transformer Engine), so that the wrapper takes its branch for the local layers and
    does not also shard the ColumnParallelLinears inside the layers it has sharded already (which
    ``fully_shard`` refuses for DTensor parameters).
    """
    import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
        TorchFullyShardedDataParallelConfig,
    )
    from torch.distributed.device_mesh import DeviceMesh

    class _MeshOnCpu:
        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return DeviceMesh.from_group(group, "cpu", *args, **kwargs)

    model.config.transformer_impl = "local"
    saved = torch_fsdp.DeviceMesh
    if not torch.cuda.is_available():
        torch_fsdp.DeviceMesh = _MeshOnCpu
    try:
        return torch_fsdp.TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
    finally:
        torch_fsdp.DeviceMesh = saved


def train_step_ddp(ddp_model, optimizer, seed: int) -> float:
    """One training step as Megatron's training loop does it: zero the DDP grad buffers, forward /
    backward, reduce the grads, optimizer.step(). Returns the loss before the update. Also steps a
    model in megatron-core's TorchFullyShardedDataParallel (its grad-buffer calls are no-ops; FSDP2
    reduce-scatters the grads in backward)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    causal_mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1).view(1, 1, SEQ, SEQ)
    with megatron_ddp_on_cpu(), megatron_optimizer_on_cpu():
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp_model(tokens, position_ids, causal_mask, labels=labels).float().mean()
        loss.backward()
        ddp_model.finish_grad_sync()
        assert optimizer.step()[0]
    return float(loss.detach())


class _TorchOnCpu(types.ModuleType):
    """``torch`` as seen by a Megatron module, with device="cuda" scalars made on the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _cpu(kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return kwargs

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))


@contextlib.contextmanager
def megatron_optimizer_on_cpu():
    """Lets Megatron's optimizer wrappers (FP32Optimizer, ChainedOptimizer) run on the CPU."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.utils as utils

    modules = (optimizer, clip_grads, utils)
    saved = [m.torch for m in modules]
    for m in modules:
        m.torch = _TorchOnCpu()
    try:
        yield
    finally:
        for m, t in zip(modules, saved):
            m.torch = t


# The names Tensor.type() gives CUDA tensors, which Megatron's mixed-precision wrappers require.
_CUDA_TYPE_NAMES = {
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.float32: "torch.cuda.FloatTensor",
}


@contextlib.contextmanager
def mixed_precision_wrapper_on_cpu():
    """Lets Megatron's Float16OptimizerWithFloat16Params take CPU parameters.

    The wrapper sorts parameters by ``param.type()`` and accepts only the CUDA type names
    ("torch.cuda.BFloat16Tensor", ...), so on a CPU it refuses every parameter. Inside this
    context a CPU tensor of those dtypes reports the CUDA name; nothing else changes. Megatron's
    layer-wise distributed optimizer (``dist_muon``) wraps its optimizers only for bf16, so it
    needs this (and megatron_optimizer_on_cpu) to run on a CPU at all.
    """
    original = torch.Tensor.type

    def type_as_on_cuda(self, *args, **kwargs):
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, *args, **kwargs)

    torch.Tensor.type = type_as_on_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


@contextlib.contextmanager
def dist_checkpointing_on_cpu():
    """Lets megatron.core.dist_checkpointing's torch_dist save run on the CPU.

    Its writer calls torch.cuda.synchronize() after the (host) copies, puts a failure flag on
    torch.cuda.current_device(), and logs the process memory with psutil (not a dependency of
    megatron-core); on a machine without CUDA those become a no-op, the CPU and 0.
    """
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async

    saved = (torch.cuda.synchronize, torch.cuda.current_device, filesystem_async._process_memory)
    had_queue = getattr(filesystem_async, "_results_queue", None) is not None
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    if not getattr(filesystem_async, "HAVE_PSUTIL", True):
        filesystem_async._process_memory = lambda: 0
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device, filesystem_async._process_memory = saved
        # The writer keeps a multiprocessing Manager (a server process) for its results queue;
        # stop the one started here, so that no process outlives the test or a worker that
        # leaves with os._exit.
        queue = getattr(filesystem_async, "_results_queue", None)
        if queue is not None and not had_queue:
            manager = getattr(queue, "_manager", None)
            filesystem_async._results_queue = None
            if manager is not None:
                manager.shutdown()


def assert_same_state(a, b, where="state_dict"):
    """Equal nested state dicts: same keys, same types, tensors equal in dtype, shape and values."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(a, key=str), sorted(b, key=str))
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)
