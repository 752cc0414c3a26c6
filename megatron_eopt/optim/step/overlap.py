"""Newton–Schulz overlapped with backward (``overlap_backward=True``).

Every parameter of the plan gets a post-accumulate-grad hook. During ``loss.backward()`` a hook
marks its parameter's gradient final; once every member of a chunk (``step.grouping``'s chunks, the
same the step uses) has a final gradient, the chunk's first two phases run: momentum into its
Newton–Schulz inputs, then the batched Newton–Schulz (with the exchanges of sharded matrices).
``step()`` waits for that work, runs the chunks that did not start (a parameter without a
gradient, a chunk whose gradients came last) and applies every update in chunk order.

Under DDP (``overlap_with_ddp``) a gradient is final when its bucket is all-reduced: a comm hook
averages the bucket as DDP does and marks its parameters then (``no_sync()`` calls no comm hook).
Under a data-parallel wrapper that keeps the gradients itself (Megatron-LM's DDP: ``main_grad``
buffers reduced per bucket group), its integration announces the wrapped parameters
(``announced_by_wrapper``: their accumulation marks nothing) and, as each bucket is reduced, calls
``grads_final`` with the optimizer's parameters whose gradients are then final, on the caller's
thread in the order the buckets were reduced (the same on every rank).

Where the work runs: on a CUDA device, on a side stream of its own, ordered after the stream the
gradient was produced on (FSDP2 calls the hooks of its sharded parameters after the
reduce-scatter, on its post-reduce stream), and ``step()`` makes the current stream wait for it.
On the CPU, chunks without collectives run on one worker thread (the backward continues on the
caller's thread); a chunk with collectives (sharded matrices, tensor-parallel stacks) runs in the
hook itself, so that every rank issues its collectives in the same order, the order in which
backward finalizes the gradients (the same on every rank of an SPMD model).

The results are bitwise those of the same optimizer without overlap, by construction: both steps
are the one engine's (``step.engine``; this module uses nothing of the optimizer but the engine):
the plain step begins and runs every chunk in plan order in ``step()``, the overlapped one begins
when the first gradient is final, starts chunks (momentum, Newton–Schulz) as their gradients come,
in any order, and runs the rest in ``step()`` the same way. A chunk's owners (sharded matrices,
layer-sharded homes) are balanced from loads the plan decides (``step.balance``), not from the
order chunks start. What cannot be reproduced is refused:

- a gradient changed after its chunk started (a clip that scales it, GradScaler's unscale, a
  second micro-batch accumulated into it) raises at ``step()`` (before any update is applied; the
  momentum of the started chunks has advanced). A second backward into a consumed gradient raises
  in the hook. Gradient accumulation: FSDP2 calls no hook while
  ``set_requires_gradient_sync(False)``, DDP none under ``no_sync()``; plain loops wrap non-final
  micro-batches in ``with optimizer.accumulating():``.
- ``momentum`` / ``weight_decay`` are read when the first chunk starts; a change before ``step()``
  raises (set them before ``backward()``); ``lr`` is read by ``step()`` as always.
- ``torch.amp.GradScaler`` (its scale and inf check arrive with ``step()``) is refused.

``zero_grad()`` between backward and ``step()`` drops the started work (with a warning: the
momentum of those matrices has advanced without an update); ``state_dict()`` waits for it;
``load_state_dict()`` drops it. A compiled ``step()`` finishes the work outside the graph (a graph
break: not with ``fullgraph=True``). Memory: each started chunk keeps its fp32 Newton–Schulz
results until ``step()``, up to one fp32 copy of every matrix, where the step alone keeps one chunk's.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ...step_stats import StepStats, merge_into_recording, recording_into
from ..multirank.dtensor_layout import local
from .engine import ChunkWork, StepEngine, StepRun
from .grouping import Plan

# What the momentum phase reads from a param group (lr and the rest are read by step()).
MOMENTUM_PHASE_KEYS = ("momentum", "weight_decay")

# A parameter whose final gradient its data-parallel wrapper announces (grads_final), not autograd's accumulation.
_ANNOUNCED = "_megatron_eopt_grad_final_announced"
# Each parameter of an overlapped optimizer's plan -> a weak reference to that optimizer's BackwardOverlap.
_OVERLAPS = WeakIdKeyDictionary()


def announced_by_wrapper(params) -> None:
    """Says that the final gradients of ``params`` are announced by their data-parallel wrapper's
    integration (``grads_final``): their post-accumulate-grad hooks mark nothing (under Megatron-LM's
    DDP autograd accumulates a micro-batch's gradient, which DDP then adds to its ``main_grad`` buffer
    and reduces with its bucket)."""
    for p in params:
        setattr(p, _ANNOUNCED, True)


def overlapping(p: torch.Tensor) -> bool:
    """Whether ``p`` is in the plan of an optimizer constructed with ``overlap_backward=True``."""
    ref = _OVERLAPS.get(p)
    return ref is not None and ref() is not None


def grads_final(params, wait=None) -> None:
    """A data-parallel wrapper's integration: the gradients now in ``.grad`` of ``params`` (optimizer
    parameters) are final; the overlapped optimizers holding them start each chunk this completes.
    ``wait`` (optional): makes the gradients' reduction complete for what reads them next, called
    once before anything reads them, on the stream the work runs on (a CUDA side stream: NCCL's
    wait orders it after the reduction without blocking the host; the CPU: gloo's wait blocks).
    Called on the thread that runs backward, in the order the wrapper reduced the gradients.

    The gradients must not change before ``step()``: the integration refuses what would change them
    (a clip of these gradients, a loss scale unscaled in ``step()``). ``step()`` checks that each is
    still the same tensor, not its version (a flat buffer's version counts writes to any part of it)."""
    by_overlap: dict[int, tuple] = {}
    for p in params:
        ref = _OVERLAPS.get(p)
        overlap = None if ref is None else ref()
        if overlap is not None:
            by_overlap.setdefault(id(overlap), (overlap, []))[1].append(p)
    for overlap, members in by_overlap.values():
        overlap.on_wrapper_reduced(members, wait)


@dataclass
class BackwardWork:
    """One backward's work: the gradients seen final, the chunks started, their results."""

    plan: Plan
    chunks: tuple  # the plan's chunks when the work began (workspace_mib may change them later)
    chunk_of: dict  # entry index -> chunk index
    waiting: list  # per chunk: members whose gradient is not final yet (None: the chunk waits for step())
    # entry index -> [grad, its version]: taken when the grad is final, and again whenever a grad
    # sharing its storage is (FSDP2's grads of one group are views of one buffer: one version counter)
    versions: dict = field(default_factory=dict)
    by_storage: dict = field(default_factory=dict)  # a storage's address -> the version records of its grads
    run: StepRun | None = None  # the step, begun by the engine when the first gradient was final
    off: bool = False  # this step does not overlap (step() does it all, and raises what it must)
    hyper: dict = field(default_factory=dict)  # group index -> {key: value when the first chunk started}
    started: dict = field(default_factory=dict)  # chunk index -> ChunkWork or Future of one
    error: BaseException | None = None  # what stopped the work; step() raises it
    seconds: float = 0.0  # host time of the work done before step()
    stats: list = field(default_factory=list)  # StepStats of the work, one per thread that did some


class BackwardOverlap:
    """The hooks and the in-flight work of one optimizer (see the module docstring)."""

    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine  # the optimizer's step (step.engine): the overlap's one door to it
        self._handles: dict[int, Any] = {}  # id(param) -> hook handle
        self._tracked: dict[int, Any] = {}  # id(param) -> weak reference, for the params in _OVERLAPS
        self.accumulating_depth = 0
        self.ddp = False  # gradients final when DDP's buckets are all-reduced (attach_ddp)
        self.work: BackwardWork | None = None
        # The hooks of parameters on different devices run on autograd's per-device threads, and the
        # worker shares the below-eps counters with them: one lock for the bookkeeping, the engine's.
        self.lock = engine.lock
        self._executors: list[ThreadPoolExecutor] = []  # the worker, once made (a list: _close holds it)
        self._streams: dict[torch.device, Any] = {}
        # hooks and the worker go with the optimizer (and its engine)
        weakref.finalize(engine, _close, self._handles, self._executors)

    # ------------------------------------------------------------------ hooks
    def sync_hooks(self, plan: Plan) -> None:
        """One hook per parameter of ``plan``; parameters no longer in it lose theirs."""
        wanted = {id(e.param): e.param for e in plan.entries}
        for pid in [pid for pid in self._handles if pid not in wanted]:
            self._handles.pop(pid).remove()
        ref = weakref.ref(self)
        for pid in [pid for pid in self._tracked if pid not in wanted]:
            p = self._tracked.pop(pid)()
            if p is not None and _OVERLAPS.get(p) is not None and _OVERLAPS[p]() is self:
                del _OVERLAPS[p]
        for pid, p in wanted.items():
            if pid not in self._tracked:
                self._tracked[pid] = weakref.ref(p)
                _OVERLAPS[p] = ref
            if pid not in self._handles and p.requires_grad:  # a frozen param gets no grad (nor a hook)
                self._handles[pid] = p.register_post_accumulate_grad_hook(_hook(ref))

    @contextlib.contextmanager
    def accumulating(self):
        self.accumulating_depth += 1
        try:
            yield
        finally:
            self.accumulating_depth -= 1

    def on_grad_final(self, p: torch.Tensor) -> None:
        """A parameter's post-accumulate-grad hook (FSDP2: after the reduce-scatter)."""
        if self.ddp or getattr(p, _ANNOUNCED, False):  # final when its bucket is reduced (on_bucket_reduced,
            return  # on_wrapper_reduced)
        self._mark_final(p)

    def on_wrapper_reduced(self, params, wait=None) -> None:
        """``grads_final``: the gradients of ``params`` (members of this optimizer's plan) are final."""
        if wait is not None:
            devices = {local(p).device for p in params}
            cuda = [d for d in devices if d.type == "cuda"]
            if cuda:
                with torch.cuda.stream(self._side_stream(cuda[0])):
                    wait()
            else:
                wait()
        for p in params:
            self._mark_final(p, announced=True)

    def on_bucket_reduced(self, params) -> None:
        """DDP's comm hook: a bucket's gradients are averaged over the ranks, in place. Runs on a
        communication thread: nothing is raised there (an error stops the work; step() raises it),
        and a parameter without a gradient (unused) leaves its chunk to step()."""
        try:
            for p in params:
                if p.grad is not None:
                    self._mark_final(p, in_callback=True)
        except BaseException as exc:  # noqa: BLE001 - kept for step()
            with self.lock:
                if self.work is not None and self.work.error is None:
                    self.work.error = exc

    def attach_ddp(self, ddp_module) -> None:
        """Takes DDP's gradients when their bucket is all-reduced, not when they are accumulated."""
        import torch.distributed as dist

        if not getattr(ddp_module, "gradient_as_bucket_view", False):
            raise ValueError(
                "overlap_backward with DDP reads the gradients when their bucket is all-reduced: construct "
                "DistributedDataParallel(..., gradient_as_bucket_view=True) (with False DDP copies them into "
                "param.grad only at the end of backward)")
        group = ddp_module.process_group
        ref = weakref.ref(self)

        def comm_hook(state, bucket):
            # DDP's own averaging (torch's allreduce_hook: divide, then sum), then the bucket's params are final
            params = bucket.parameters()
            buffer = bucket.buffer()
            buffer.div_(group.size())
            future = dist.all_reduce(buffer, group=group, async_op=True).get_future()

            def reduced(f):
                value = f.value()[0]  # (raises first if the all-reduce failed)
                overlap = ref()
                if overlap is not None:
                    overlap.on_bucket_reduced(params)
                return value

            return future.then(reduced)

        ddp_module.register_comm_hook(None, comm_hook)
        self.ddp = True

    def _mark_final(self, p: torch.Tensor, in_callback: bool = False, announced: bool = False) -> None:
        if self.accumulating_depth or torch.compiler.is_compiling():
            return
        engine = self.engine
        with self.lock:
            work = self.work
            if work is not None and (work.off or work.error is not None):
                return
            plan = engine.plan() if work is None else work.plan
            i = plan.index.get(id(p))
            if i is None:
                return
            if work is None:
                work = self.work = self._begin(plan)
                if work.off:
                    return
            if i in work.versions:
                raise RuntimeError(
                    f"{engine.name}(overlap_backward=True): a second backward accumulated into the gradient of "
                    f"the {tuple(p.shape)} parameter after its Newton–Schulz started; call step() between backward "
                    "passes, or run the non-final micro-batches inside `with optimizer.accumulating():`"
                )
            g = p.grad
            record = [g, None]
            # A wrapper's flat gradient buffer (Megatron DDP's) is written as a whole after the reduction
            # (the clip of other optimizers' gradients in it): its one version counter says nothing of this
            # gradient. The wrapper's integration refuses what would change it (``grads_final``); step()
            # checks that the gradient is still the same tensor.
            if g is not None and not announced:
                # Views of one buffer share a version counter (FSDP2's grads of a group, flat gradient
                # buffers): this grad's accumulation bumped its consumed siblings' too. Re-taken here,
                # so a change made after the last of them was marked (a clip, DDP's all-reduce) still shows.
                siblings = work.by_storage.setdefault(local(g).untyped_storage().data_ptr(), [])
                siblings.append(record)
                for sibling in siblings:
                    sibling[1] = local(sibling[0])._version
            work.versions[i] = record
            c = work.chunk_of[i]
            if work.waiting[c] is None:
                return
            work.waiting[c] -= 1
            if work.waiting[c] == 0:
                self._start_chunk(work, c, in_callback)

    # ------------------------------------------------------------------ the work
    def _begin(self, plan: Plan) -> BackwardWork:
        """The step's per-step setup (the engine's ``begin``), done when the first gradient of a
        backward is final. A step that cannot overlap is marked off (step() then does everything and
        raises what it must)."""
        engine = self.engine
        chunk_of = {}
        waiting = []
        for c, chunk in enumerate(plan.chunks):
            for i in chunk:
                chunk_of[i] = c
            devices = {local(plan.entries[i].param).device for i in chunk}
            waiting.append(len(chunk) if len(devices) == 1 else None)  # a chunk on two devices runs in step()
        work = BackwardWork(plan, plan.chunks, chunk_of, waiting)
        if engine.fused_step_refused():
            work.off = True
            return work
        try:
            engine.write_hyperparameters(plan, [True] * len(plan.entries))
        except (ValueError, TypeError, RuntimeError):
            work.off = True
            return work
        for gi, group in enumerate(engine.param_groups):
            work.hyper[gi] = {k: _snapshot(group[k]) for k in MOMENTUM_PHASE_KEYS if k in group}
        work.run = engine.begin(plan, revertible=True)
        return work

    def _start_chunk(self, work: BackwardWork, c: int, in_callback: bool = False) -> None:
        engine, plan = self.engine, work.plan
        members = work.chunks[c]
        try:
            engine.check_grads(plan, members)
        except (ValueError, TypeError) as exc:
            work.error = exc
            return
        device = work.run.chunk_device(members)
        collectives = engine.communicates(plan, members)
        if device.type == "cpu" and not collectives and engine.runs_anywhere():
            # (an orthogonalize() override runs inline: it reads the optimizer's per-call batch table)
            work.started[c] = self._worker().submit(self._run, work, c, members)
            return
        if in_callback and (collectives or device.type == "cpu"):
            return  # not from a communication thread: step() runs it
        if collectives:
            # Every rank must start this chunk's collectives with the same grads (a parameter unused on
            # one rank leaves its chunk unstarted there): agreed first, the same error on every rank.
            agreed = StepStats()
            try:
                with recording_into(agreed):  # counted with the step's work
                    work.run.agree_chunk(c, members)
            except BaseException as exc:
                work.error = exc
                raise
            finally:
                with self.lock:
                    work.stats.append(agreed)
        try:
            if device.type == "cuda":
                stream = self._side_stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                for i in members:  # the grads are read on the side stream
                    local(plan.entries[i].param.grad).record_stream(stream)
                with torch.cuda.stream(stream):
                    work.started[c] = self._run(work, c, members)
            else:
                work.started[c] = self._run(work, c, members)
        except BaseException as exc:
            work.error = exc  # step() raises it too; nothing more starts
            raise

    def _run(self, work: BackwardWork, c: int, members) -> ChunkWork:
        """Momentum and Newton–Schulz of chunk ``c`` (the engine's ``start``), into buffers of its own
        (kept until step())."""
        stats = StepStats()
        start = time.perf_counter()
        device_type = local(work.plan.entries[members[0]].param).device.type
        # as in step(): no autocast (a backward called inside an autocast region runs its hooks in it)
        with torch.no_grad(), torch.autocast(device_type, enabled=False), recording_into(stats):
            chunk = work.run.start(c, members)
        with self.lock:
            work.seconds += time.perf_counter() - start
            work.stats.append(stats)
        return chunk

    def _side_stream(self, device: torch.device):
        """The CUDA stream this optimizer's overlapped work runs on, on ``device``."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _worker(self) -> ThreadPoolExecutor:
        if not self._executors:
            # The worker's ops use as many threads as the caller's (a new thread would get OpenMP's default).
            self._executors.append(ThreadPoolExecutor(1, thread_name_prefix="megatron-eopt-overlap",
                                                      initializer=torch.set_num_threads,
                                                      initargs=(torch.get_num_threads(),)))
        return self._executors[0]

    def wait(self) -> None:
        """Waits for the in-flight work (its results stay pending for step())."""
        work = self.work
        if work is None:
            return
        for c, started in list(work.started.items()):
            if isinstance(started, Future):
                try:
                    work.started[c] = started.result()
                except BaseException as exc:  # noqa: BLE001 - re-raised by step()
                    del work.started[c]
                    work.error = work.error or exc
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
        if self._streams:  # buffers made on a side stream, read and freed on the current one
            for started in work.started.values():
                for t in started.tensors():
                    if t.is_cuda:
                        t.record_stream(torch.cuda.current_stream(t.device))

    def held_bytes(self) -> int:
        """Bytes the started chunks hold until step() (their Newton–Schulz inputs and results)."""
        self.wait()
        work = self.work
        storages = {}
        for started in ([] if work is None else work.started.values()):
            for t in started.tensors():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def discard(self, why: str | None) -> None:
        """Drops the pending work (after waiting for it), warning when some had started (``why``:
        what dropped it; None: no warning). The low-memory seeds go back to where they were."""
        self.wait()
        with self.lock:
            work, self.work = self.work, None
        if work is None:
            return
        if work.run is not None:
            work.run.cancel()
        if work.started and why is not None:
            warnings.warn(
                f"{self.engine.name}(overlap_backward=True): {why} dropped the Newton–Schulz work that backward "
                f"started for {len(work.started)} chunk(s); the momentum of their matrices has advanced without an "
                "update. Call step() first to apply it.", stacklevel=3)

    # ------------------------------------------------------------------ step()
    def finish(self) -> None:
        """The rest of the step, after backward started some of it: the engine's ``run_chunks`` and
        ``finish``, as the plain step calls them. A refusal drops the step (the low-memory seeds go
        back; the momentum of started chunks has advanced)."""
        self.wait()
        with self.lock:
            work, self.work = self.work, None
        engine, run, error = self.engine, work.run, None
        active = None
        try:
            self._check(work)
            active = [e.param.grad is not None for e in work.plan.entries]
            engine.write_hyperparameters(work.plan, active)  # lr and the others, read by step() as always
        except (ValueError, TypeError, RuntimeError) as exc:
            error = exc
        try:
            # The chunks backward did not start, whose work communicates, agree as they would have
            # there (a parameter without a grad on this rank only is named), then the step once more.
            run.agree_finish(error)
        except BaseException:
            run.cancel()
            raise
        merge_into_recording(work.stats, work.seconds)
        run.run_chunks(active)  # the chunks the work began with, in plan order
        run.finish()

    def _check(self, work: BackwardWork) -> None:
        """What step() refuses before it applies anything."""
        engine = self.engine
        name = engine.name
        plan = engine.plan()
        if plan is not work.plan:
            raise RuntimeError(f"{name}(overlap_backward=True): the parameters changed between backward and step(); "
                               "the work backward started was dropped")
        if work.error is not None:
            raise work.error
        if engine.grad_scaler_in_use():
            raise RuntimeError(f"{name}(overlap_backward=True) does not compose with torch.amp.GradScaler: its scale and "
                               "inf check arrive with step(), after backward started the work; construct the optimizer "
                               "with overlap_backward=False to use a GradScaler")
        for i, (grad, version) in work.versions.items():
            p = plan.entries[i].param
            if p.grad is not grad or (grad is not None and version is not None and local(grad)._version != version):
                raise RuntimeError(
                    f"{name}(overlap_backward=True): the gradient of the {tuple(p.shape)} parameter changed after "
                    "backward started its Newton–Schulz (a clip that scales it, an unscale, another micro-batch "
                    "accumulated into it, a DDP all-reduce); clip with policy='adamw' (megatron_eopt.clipping), run "
                    "non-final micro-batches inside `with optimizer.accumulating():`, or use overlap_backward=False"
                )
        for gi, values in work.hyper.items():
            for key, value in values.items():
                now = engine.param_groups[gi].get(key)
                if not _same(value, now):
                    raise ValueError(
                        f"param_groups[{gi}][{key!r}] changed after backward started the step's momentum "
                        f"({value!r} -> {now!r}); with overlap_backward=True set it before loss.backward()"
                    )
        engine.check_grads(plan, [i for i, e in enumerate(plan.entries) if e.param.grad is not None])


def _close(handles: dict, executors: list) -> None:
    """The optimizer is gone: its hooks and worker go too."""
    for handle in handles.values():
        handle.remove()
    handles.clear()
    for executor in executors:
        executor.shutdown(wait=False)


def _hook(ref):
    def hook(p: torch.Tensor) -> None:
        overlap = ref()
        if overlap is not None:
            overlap.on_grad_final(p)
    return hook


def _snapshot(value):
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _same(a, b) -> bool:
    """Equal values (a Python number and a one-element tensor of the same value are)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if all(isinstance(v, (int, float, torch.Tensor)) and (not isinstance(v, torch.Tensor) or v.numel() == 1)
               for v in (a, b)):
            return float(a) == float(b)
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and bool(torch.equal(a, b.to(a.device)))
    return a == b
