"""The one engine of the fused step, for the plain step and the step overlapped with backward.

A step of the fused path is::

    run = engine.begin(plan)            # per-step setup
    run.start(k, members)               # (overlap only) chunk k's momentum and Newton–Schulz, early
    run.run_chunks(active)              # every chunk in plan order: a started one is applied,
                                        # the others run whole (momentum, Newton–Schulz, update)
    run.finish()

``begin`` does everything a step does once: the low-memory state's seeds advance (and, for a step
begun during backward, are kept to restore if the step is dropped), GradScaler's tensors are copied
per device, the below-eps counters are zeroed, and each chunk's owner loads are read from the plan
(``step.balance``). The hyper-parameter tensors are written (after their check) by
``write_hyperparameters``, before ``begin``: the plain step checks everything before the ranks agree
and before anything changes.

The plain step (``OrthogonalizedOptimizer._run_step``) calls ``begin`` and ``run_chunks``; the
overlapped step (``step.overlap``) calls ``begin`` when the first gradient of a backward is final,
``start`` for each chunk whose gradients are all final, in whatever order they come, and
``run_chunks`` from ``step()``. Both run the same code on the same inputs: a chunk's phases are
``FusedStep``'s, its owners are balanced from loads that depend on the plan only (never on which
chunk started first), its Newton–Schulz inputs are laid out alike (``step.layout``: each chunk's
stacks from offset 0 of a buffer, 256-byte aligned), and the updates are applied in plan order.
So the overlapped step's results are bitwise the plain step's by construction.

The engine is the only door from the overlap to the optimizer: ``StepEngine``'s methods and the
``StepRun`` it returns are what ``step.overlap`` uses.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..multirank.dtensor_layout import local
from .balance import chunk_start_loads
from .grouping import Plan
from .layout import ChunkLayout, cached_step_layouts, chunk_layout, step_layouts


@dataclass
class ChunkWork:
    """A chunk whose momentum and Newton–Schulz ran: what its update needs."""

    layout: ChunkLayout
    launches: list
    updates: dict
    scales: dict
    ns_inputs: dict

    def tensors(self) -> tuple:
        """The buffers it holds until its update (its Newton–Schulz inputs and results)."""
        return (*self.updates.values(), *self.ns_inputs.values())


class StepEngine:
    """The fused step of one optimizer (see the module docstring)."""

    def __init__(self, optimizer) -> None:
        self._opt = optimizer
        # The below-eps counters and the overlap's bookkeeping are shared by the hooks (autograd's
        # per-device threads) and the overlap's worker thread.
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ what a step reads
    @property
    def name(self) -> str:
        return type(self._opt).__name__

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._opt.param_groups

    def plan(self) -> Plan:
        """The current plan (rebuilt once when the groups' parameters changed)."""
        return self._opt._current_plan()

    def fused_step_refused(self) -> bool:
        """Whether this step cannot take the fused path as it stands (an extension point
        overridden, a step-time error, a matrix sharded across ranks with a weight-update hook or an
        ``orthogonalize`` override): ``step()`` then does it all, and raises what it must."""
        opt = self._opt
        return not opt._use_fused_step() or opt._step_time_error() is not None \
            or opt._spanning_matrix_error() is not None

    def grad_scaler_in_use(self) -> bool:
        """Whether ``torch.amp.GradScaler`` handed this step its scale or inf check."""
        grad_scale, found_inf = self._opt._grad_scaler_tensors()
        return grad_scale is not None or found_inf is not None

    def runs_anywhere(self) -> bool:
        """Whether a chunk's work may run on another thread (not with an ``orthogonalize`` override,
        which reads the optimizer's per-call table of batched results)."""
        return self._opt._orthogonalize_is_base()

    @staticmethod
    def communicates(plan: Plan, members) -> bool:
        """Whether the work of the chunk with these entries calls collectives."""
        for i in members:
            if plan.entries[i].spans_ranks:
                return True
            stack = plan.stacks[plan.entries[i].stack_index]
            if stack.tp is not None or stack.gtp is not None or stack.home is not None:
                return True
        return False

    # ------------------------------------------------------------------ checks, before anything changes
    def check_grads(self, plan: Plan, indices) -> None:
        """The grads of the entries ``indices`` (each has one), checked against their params."""
        self._opt._check_grads_of(plan, indices)

    def write_hyperparameters(self, plan: Plan, active: list[bool]) -> None:
        """Checks the per-step values of the groups in use, then writes them to the step's tensors."""
        self._opt._write_hyperparameters(plan, active)

    def agree(self, plan: Plan, members, error: Exception | None, chunk: int | None = None) -> None:
        """The ranks' agreement (``multirank.agreement``) before the step (``members`` None: with every
        entry's grad reported, or none where ``chunk`` is -1, step() finishing an overlapped step) or
        before chunk ``chunk`` starts (``members``: its entries, whose grads are reported)."""
        active = None
        if members is not None:
            active = [None] * len(plan.entries)
            for i in members:
                active[i] = plan.entries[i].param.grad is not None
        self._opt._agree_step(plan, active, error, chunk=chunk)

    # ------------------------------------------------------------------ the step
    def begin(self, plan: Plan, revertible: bool = False, optimizer=None) -> "StepRun":
        """The step's setup (see the module docstring). ``revertible``: a step begun before
        ``step()`` (during backward), which ``StepRun.cancel`` may drop. ``optimizer``: the optimizer
        as its caller holds it (the plain step passes ``self``: inside a compiled step, torch.compile
        sees writes made through one reference to an object, such as a plan rebuilt after params were
        swapped into a group, and must read them back through the same one)."""
        return StepRun(self, plan, revertible, self._opt if optimizer is None else optimizer)


class StepRun:
    """One step of a :class:`StepEngine`, from ``begin`` to ``finish``."""

    def __init__(self, engine: StepEngine, plan: Plan, revertible: bool, optimizer) -> None:
        self.opt = opt = optimizer
        self.engine = engine
        self.plan = plan
        self.chunks = plan.chunks  # the chunks the step began with (workspace_mib may change the plan's)
        self.started: dict[int, ChunkWork] = {}  # chunk index -> its work, started ahead of step()
        self._agreed: set[int] = set()  # the chunks whose start the ranks agreed on (agree_chunk)
        seeds = opt._state_seeds
        self._seeds = {device: seed.clone() for device, seed in seeds.items()} if revertible else None
        for seed in seeds.values():  # new draws for the stochastic rounding of this step
            seed.add_(1)
        self.scalers = opt._scaler_tensors_per_device(plan)
        opt._reset_ns_inputs_below_eps(plan)
        self._loads = chunk_start_loads(plan, self.chunks, cache=not torch.compiler.is_compiling())

    # ------------------------------------------------------------------ the ranks' agreement
    # A step begun during backward agrees once per chunk whose work communicates, before it starts
    # (the ranks must enter its collectives with the same grads), wherever it starts: in backward, or
    # in step() for a chunk that did not start there (its grads came last, or one is missing on some
    # rank). Every rank thus makes the same agreements in the same order, whichever chunks started
    # where, and one more in step(). (The plain step agrees once, before begin: it has every grad.)
    def agree_chunk(self, k: int, members, error: Exception | None = None) -> None:
        """The ranks agree on chunk ``k``'s start, with the grads of ``members`` (once per chunk)."""
        self._agreed.add(k)
        self.engine.agree(self.plan, members, error, chunk=k)

    def agree_finish(self, error: Exception | None) -> None:
        """In step(): every communicating chunk not agreed on yet agrees, then the step once more (a
        refusal seen here by some ranks only must not leave the others updating alone)."""
        engine = self.engine
        for k, chunk in enumerate(self.chunks):
            if k not in self._agreed and engine.communicates(self.plan, chunk):
                self.agree_chunk(k, chunk, error)
        engine.agree(self.plan, None, error, chunk=-1)

    # ------------------------------------------------------------------ the chunks
    def _chunk_loads(self, k: int) -> dict:
        """Chunk k's starting owner loads (a copy: the chunk's balancing updates it)."""
        if self._loads is None:
            return {}
        return {key: list(load) for key, load in self._loads[k].items()}

    def start(self, k: int, members) -> ChunkWork:
        """Momentum and Newton–Schulz of chunk ``k``'s ``members`` (entries with a final grad), into
        buffers of its own kept until ``run_chunks`` applies them."""
        layout = chunk_layout(self.plan, list(members), k)
        work = self._start(layout, self.opt._ns_input_buffers((layout,)))
        self.started[k] = work
        return work

    def _start(self, layout: ChunkLayout, inputs: dict) -> ChunkWork:
        opt, plan = self.opt, self.plan
        ns_inputs, stacked = opt._ns_input_views(plan, layout, inputs)
        launches = opt._momentum_phase(plan, layout, ns_inputs, self.scalers)
        loads = {} if self._loads is None else self._chunk_loads(layout.chunk)
        updates, scales = opt._orthogonalize_phase(plan, layout.members, ns_inputs, stacked, loads)
        return ChunkWork(layout, launches, updates, scales, ns_inputs)

    def _apply(self, work: ChunkWork) -> None:
        self.opt._update_phase(self.plan, work.launches, work.updates, work.scales, work.ns_inputs)

    def run_chunk(self, layout: ChunkLayout, inputs: dict) -> None:
        """Every phase of one chunk. A function of its own so that the chunk's results (memory of
        their own where the Newton–Schulz is not in place) are freed on return, before the next
        chunk allocates its own: the step's transient stays one chunk's."""
        self._apply(self._start(layout, inputs))

    def run_chunks(self, active: list[bool]) -> None:
        """The rest of the step, chunk by chunk in plan order: a started chunk's update is applied,
        a chunk not started runs whole with its entries that have a grad (``active``, per entry); the
        chunks not started share one flat buffer of Newton–Schulz inputs."""
        plan = self.plan
        if not self.started and self.chunks is plan.chunks:
            # The same every step with the same grads present, so an eager step reuses it (a compiled
            # one traces it, without the cache's side effects).
            layouts = step_layouts(plan, active) if torch.compiler.is_compiling() else cached_step_layouts(plan, active)
        else:
            layouts = []
            for k, chunk in enumerate(self.chunks):
                members = [i for i in chunk if active[i]] if k not in self.started else None
                if members:
                    layouts.append(chunk_layout(plan, members, k))
        inputs = self.opt._ns_input_buffers(layouts)
        pending = {layout.chunk: layout for layout in layouts}
        started = self.started
        for k in range(len(self.chunks)):
            if k in started:
                self._apply(started.pop(k))  # (its buffers go before the next chunk runs)
            elif k in pending:
                self.run_chunk(pending[k], inputs)

    def finish(self) -> None:
        """The step's end: MuonBP counts its step (``step.block_periodic``)."""
        opt = self.opt
        if opt.block_period is not None:  # tested here: the counter is a graph break (fullgraph compile)
            opt._count_block_step()

    def cancel(self) -> None:
        """Drops a step begun during backward: the low-memory seeds go back to where they were (the
        momentum of started chunks has advanced)."""
        if self._seeds is None:
            return
        seeds = self.opt._state_seeds
        for device, before in self._seeds.items():
            seed = seeds.get(device)
            if seed is not None:
                seed.copy_(before)

    def chunk_device(self, members) -> torch.device | None:
        """The one device of these entries' parameters (None: they lie on several)."""
        devices = {local(self.plan.entries[i].param).device for i in members}
        return next(iter(devices)) if len(devices) == 1 else None
