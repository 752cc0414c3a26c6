"""The fused step shared by Muon, AdaptiveMuon and their tensor-parallel variants.

Per step, with the parameters grouped once (see ``step.grouping``), for each *chunk* (the matrices whose
Newton–Schulz buffers fit the workspace budget ``workspace_mib`` together; small models are one
chunk, a large matrix is a chunk of its own, so the step's transient memory is bounded by the
budget or by the largest matrix, not by the size of the model):

1. per bucket (param group, dtype, device): one ``foreach_momentum_`` — momentum EMA, L2 decay,
   Nesterov — writing the Newton–Schulz inputs straight into a stacked fp32 (k, m, n) buffer per
   stack (views of one flat buffer per device, reused by every chunk of the step);
2. per stack: one batched ``newton_schulz`` (QKV projections: ``newton_schulz_split``; tensor
   parallel: see ``multirank.tp_modes``);
3. AdaptiveMuon: per bucket one second-moment normalization launch on the raw NS output;
4. per bucket: one ``foreach_update_`` applying decoupled / independent / PaLM decay and
   ``p -= lr * scale * update`` with per-tensor scales.

lr, weight_decay, momentum (and AdaptiveMuon's beta2, eps) are read from the param groups at
every step (schedulers and warm-up schedules write floats or tensors) and copied into cached 0-dim
fp64 tensors per group and device, so the ops never see a Python float that changes: no graph
break or recompilation under ``torch.compile`` and, with tensor values on the device, the step can
be captured in a CUDA graph. With ``torch.amp.GradScaler`` the step reads the scaler's
``grad_scale`` and ``found_inf``: the gradients are unscaled inside the momentum op and a step with
an inf / NaN gradient changes nothing, decided on the device without a sync.

``orthogonalize(p, grad, **group)`` is Emerging-Optimizers' extension point: a subclass that
overrides it is called for every parameter with a gradient, after the fused momentum step and the
batched Newton–Schulz; the base method, called from the override, returns the batched result, so
only the parameters the override handles itself cost extra. EO's other extension points (see
``_eo_hooks``) switch the step to EO's per-parameter loop when a subclass replaces one; the
weight-update hooks of ``weight_update_hooks`` run batched inside the fused step.

The class holds the configuration, the plan and ``step()``; the rest lives in one module per
concern, mixed in: ``step.state`` (state creation, shapes, loading, saving), ``step.fused`` (the
phases above), ``_eo_hooks`` (EO's extension points, its per-parameter step and the timing of its
errors).

The class has Emerging-Optimizers 0.4's constructor (``lr, momentum, weight_decay, nesterov,
weight_decay_method, fp32_matmul_prec, scaled_orthogonalize_fn``, plus EO main's
``weight_update_hook``) for EO-style subclasses, which take the per-parameter step; the fused
classes (Muon, AdaptiveMuon, Scion, the tensor-parallel ones) set up through ``_init_fused``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ._config import (
    ConfigSetting,
    OrthogonalizationConfig,
    check_extra_scale_factor,
    check_group_hyperparameters,
    check_matmul_precision,
    check_scale_mode,
    check_weight_decay_method,
    config_setting_names,
)
from ._eo_hooks import BASE_HOOK_NAMES, EOExtensionPoints, FusedScaledOrthogonalize
from .matrix_view import check_view_keys, check_nd_mode, batched_matrix_shape, not_a_matrix, split_newton_schulz
from .multirank.agreement import (GroupScope, RankAgreement, agree, capturing_cuda_graph, meshes_of, plan_digest,
                                  step_meshes)
from .multirank.replica_work import resolve_replica_work
from .multirank.dtensor_layout import REPLICA_WORK, describe, is_dtensor, uneven_splits
from .multirank.sharded import SHARDED_MODES, ShardedOrthogonalizer
from .multirank.tp_modes import GTPLayout, TPLayout
from .step import state_dtype as _low_memory
from .step.fused import FusedStep
from .step.engine import StepEngine
from .step.overlap import BackwardOverlap
from .step.grouping import (
    DEFAULT_WORKSPACE_MIB,
    Plan,
    build_plan,
    check_workspace_mib,
    chunk_entries,
    workspace_budget_bytes,
)
from .step.ride import RidingStep
from .step.state import FusedState
from .weight_update_hooks import NoOpWeightUpdateHook
from .. import low_memory_state as lms
from ..step_stats import StepStatsReporter, records_step_stats


class OrthogonalizedOptimizer(FusedState, FusedStep, EOExtensionPoints, RankAgreement, RidingStep, StepStatsReporter,
                              torch.optim.Optimizer):
    """Emerging-Optimizers' base class of orthogonalized optimizers.

    EO's constructor: ``scaled_orthogonalize_fn(grad) -> update`` orthogonalizes (and scales) one
    2-D momentum (None: identity, as EO); further keyword arguments become param-group defaults;
    ``weight_update_hook`` (see :mod:`~megatron_eopt.optim.weight_update_hooks`) runs around the
    final update. Such an optimizer steps per parameter in EO's order and numerics: weight decay,
    momentum EMA (Nesterov blend), ``orthogonalize`` under ``fp32_matmul_prec``,
    ``pre_weight_update_fn_inplace``, hook pre, ``p -= lr·update``, ``post_weight_update_fn_inplace``,
    hook post. Subclasses override any of those methods as in EO.

    The fused classes (:class:`Muon` and the others) subclass it too and set up through
    ``_init_fused``: one batched, fused step while no extension point is overridden; the per-parameter
    step with the same numerics once one is.

    Errors come where and as Emerging-Optimizers 0.4 raises them: a parameter that is not a matrix
    (0-D, 1-D, or N-D with ``nd_mode="error"``) is accepted at construction and refused by ``step()``
    (ValueError; EO's Muon-like classes only when it has a gradient, AdaptiveMuon always), and so is
    an unknown ``weight_decay_method``, ``coefficient_type`` or ``scale_mode`` (ValueError) or
    ``moment2_method`` (TypeError) once a parameter has a gradient. Unlike EO, the step checks
    everything before it changes anything. DTensor parameters, ``nd_mode`` / ``sharded_mode`` and
    the per-group values are still checked at construction.
    """

    orthogonalizing = True  # its parameters are "the Muon part" of a clip (megatron_eopt.clipping)
    # Emerging-Optimizers 0.4's timing of the errors above; the tensor-parallel classes keep
    # refusing at construction, as before (Megatron-LM never hands them such parameters).
    _eo_step_time_errors = True
    _nd_error_type: type = ValueError  # Muown: TypeError, as EO's
    _nd_error_without_grad = False  # AdaptiveMuon: True (EO checks every param before its grad)
    _momentum_below_one = True  # torch.optim.Muon's front end: any momentum >= 0
    _workspace_mib: float | str | None = DEFAULT_WORKSPACE_MIB  # see the workspace_mib property

    # Emerging-Optimizers' attributes, each with one home: the fused configuration's field (see
    # ConfigSetting). fp32_matmul_prec is the precision of the Newton–Schulz products: "medium"
    # (bf16), "high" (TF32) or "highest" (fp32).
    nesterov = ConfigSetting("nesterov", convert=bool)
    weight_decay_method = ConfigSetting("weight_decay_method", check_weight_decay_method)
    fp32_matmul_prec = ConfigSetting("precision", check_matmul_precision, always_checked=True)
    scale_mode = ConfigSetting("scale_mode", check_scale_mode)
    extra_scale_factor = ConfigSetting("extra_scale_factor", check_extra_scale_factor)
    moment2_method = ConfigSetting("moment2_method", settable=False)

    def __init__(
        self,
        params,
        lr: float,
        momentum: float,
        weight_decay: float,
        *,
        nesterov: bool,
        weight_decay_method: str,
        fp32_matmul_prec: str,
        scaled_orthogonalize_fn: Callable | None = None,
        weight_update_hook: Any | None = None,
        **kwargs: Any,
    ) -> None:
        if scaled_orthogonalize_fn is None:
            scaled_orthogonalize_fn = torch.nn.Identity()
        self.fp32_matmul_prec = fp32_matmul_prec
        self.nesterov = nesterov
        self.weight_decay_method = weight_decay_method
        self._weight_update_hook = _effective_hook(weight_update_hook)
        self._config = None  # no fused step: scaled_orthogonalize_fn is the caller's
        self._deferred_error = None
        self._plan = None
        self._batched = None
        self._constructed = False
        torch.optim.Optimizer.__init__(self, params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, **kwargs))
        self.scaled_orthogonalize_fn = scaled_orthogonalize_fn

    def _init_eo_style(self, arguments: dict, orthogonalize_fn: Callable, deferred_error=None) -> None:
        """Emerging-Optimizers 0.4's constructor for a class whose ``scaled_orthogonalize_fn`` takes a
        matrix or a (k, m, n) stack (the per-parameter step then batches equal shapes): ``arguments``
        are the class constructor's ``locals()``; ``deferred_error`` is what ``step()`` raises."""
        orthogonalize_fn.supports_batch = True
        a = arguments
        OrthogonalizedOptimizer.__init__(
            self, a["params"], a["lr"], a["momentum"], a["weight_decay"], nesterov=a["nesterov"],
            weight_decay_method=a["weight_decay_method"], fp32_matmul_prec=a["fp32_matmul_prec"],
            scaled_orthogonalize_fn=orthogonalize_fn,
        )
        self._deferred_error = deferred_error

    def _use_config(self, config: OrthogonalizationConfig) -> None:
        """Makes ``config`` the optimizer's, with everything built from it (the plan is rebuilt)."""
        self._config = config
        self.scaled_orthogonalize_fn = FusedScaledOrthogonalize(config, scaled=config.moment2_method is None)
        self._sharded = ShardedOrthogonalizer(config)
        self._sharded.count_below_eps = self._count_below_eps
        if self._constructed:
            # An option written between steps (on some ranks only, perhaps): no collective here; the
            # next step's agreement (_agree_step) compares it between the ranks.
            self._rebuild_plan(agree_ranks=False)

    def _init_fused(self, params, defaults: dict, config: OrthogonalizationConfig, *, nd_mode: str = "error",
                    sharded_mode: str = "owner", replica_work: str = "repeat", weight_update_hook: Any | None = None,
                    state_dtype: str = "fp32",
                    state_block_size: int = lms.DEFAULT_BLOCK_SIZE, workspace_mib: float | str | None = DEFAULT_WORKSPACE_MIB,
                    deferred_error: tuple[str, type, str] | None = None, overlap_backward: bool = False) -> None:
        """Sets up the fused step: ``config`` says how every parameter is orthogonalized; ``state_dtype``
        and ``state_block_size`` how its state is stored (:mod:`megatron_eopt.low_memory_state`);
        ``workspace_mib`` bounds a step's transient memory (the ``workspace_mib`` property).
        ``deferred_error`` (``_config.defer_step_time_errors``) is what ``step()`` raises;
        ``overlap_backward``: see :mod:`.step.overlap`."""
        if not isinstance(overlap_backward, bool):
            raise TypeError(f"overlap_backward must be True or False, got {overlap_backward!r}")
        self.overlap_backward = overlap_backward
        self._engine = StepEngine(self)
        if overlap_backward:
            self._overlap = BackwardOverlap(self._engine)
        self.state_dtype = lms.validate_state_dtype(state_dtype)
        self.state_block_size = lms.validate_block_size(state_block_size)
        self._workspace_mib = check_workspace_mib(workspace_mib)
        self._state_seeds: dict[torch.device, torch.Tensor] = {}
        self._deferred_error = deferred_error
        self._weight_update_hook = _effective_hook(weight_update_hook)
        check_nd_mode(nd_mode)
        if sharded_mode not in SHARDED_MODES:
            raise ValueError(f"sharded_mode must be one of {list(SHARDED_MODES)}, got {sharded_mode!r}")
        if replica_work not in REPLICA_WORK:
            raise ValueError(f"replica_work must be one of {list(REPLICA_WORK)}, got {replica_work!r}")
        if replica_work == "split" and sharded_mode != "owner":
            raise ValueError("replica_work='split' shares each matrix's owner between replicas: it needs "
                             f"sharded_mode='owner', got sharded_mode={sharded_mode!r}")
        self.nd_mode = nd_mode
        self.sharded_mode = sharded_mode
        self.replica_work = replica_work
        self._constructed = False
        self._use_config(config)
        for name in config_setting_names(type(self)):  # the configuration holds them from now on
            self.__dict__.pop("_" + name, None)
        self._plan: Plan | None = None
        self._hyper: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {}
        self._batched: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._constructed = False
        check_group_hyperparameters(defaults, "defaults", self._momentum_below_one)
        torch.optim.Optimizer.__init__(self, params, defaults)
        self._constructed = True
        self._rebuild_plan()

    # ------------------------------------------------------------------ routing hooks
    def _tp_layout(self, p: torch.Tensor) -> TPLayout | None:
        """The tensor-parallel layout of p (None: orthogonalize the local tensor as it is)."""
        return None

    def _split_shapes_of(self, p: torch.Tensor) -> list[int] | None:
        """Split sizes when p is a fused QKV projection to orthogonalize per part."""
        return None

    def _gtp_layout(self, p: torch.Tensor) -> GTPLayout | None:
        """Megatron-LM's GTP row sharding of p (None: its rows are whole on this rank)."""
        return None

    def _home_domain(self, p: torch.Tensor):
        """The layer-sharded home domain of p (``multirank.layer_homes``; None: none)."""
        return None

    # ------------------------------------------------------------------ param groups and plan
    @torch._disable_dynamo
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self._config is None:  # EO-style: parameters are checked where EO checks them, at step()
            return
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        # Taken before the checks, so every rank agrees over the same meshes whichever check fails where.
        meshes = meshes_of(group["params"])
        error = None
        try:
            nd_mode = group.get("nd_mode", self.nd_mode)
            check_nd_mode(nd_mode, f"param_groups[{gi}]['nd_mode']")
            check_view_keys(group, f"param_groups[{gi}]")
            mesh = None
            for pi, p in enumerate(group["params"]):
                where = f"param_groups[{gi}]['params'][{pi}]"
                if self._eo_step_time_errors and not is_dtensor(p) and not_a_matrix(p, nd_mode):
                    continue  # refused by step(), where Emerging-Optimizers refuses it
                self._check_param(p, nd_mode, where)
                if is_dtensor(p):
                    if mesh is not None and p.device_mesh != mesh:
                        raise ValueError(
                            f"{where} lives on device mesh {p.device_mesh}, other params of param_groups[{gi}] on "
                            f"{mesh}: one param group takes params of one mesh (put the others in their own group)"
                        )
                    mesh = p.device_mesh
                    # rejects Partial and impossible views (the shards are checked with the plan)
                    describe(p, nd_mode, self.sharded_mode, where, None,
                             "repeat" if self.replica_work == "auto" else self.replica_work, check_local=False)
                    _low_memory.check_sharding(p, self.state_dtype, self.state_block_size, where)
            check_group_hyperparameters(group, f"param_groups[{gi}]", self._momentum_below_one)
        except Exception as exc:  # refused on this rank: every rank of the group's meshes refuses it
            error = exc
        try:
            # (the fields too: a group added on some ranks only pairs with the others' next agreement)
            agree(meshes, error, what=type(self).__name__, fields=self._agreement_fields() if meshes else ())
            if self._constructed:
                self._rebuild_plan()
                self._drop_ride_ticket()  # (every rank agreed on the group: the next step agrees afresh)
        except Exception:
            self.param_groups.pop()
            if self._constructed:
                self._rebuild_plan()
            raise

    def _not_a_matrix_message(self, p: torch.Tensor, where: str) -> str:
        hint = (
            "pass nd_mode='batch' (leading dims index independent matrices, e.g. MoE experts (E, m, n)) or "
            "nd_mode='flatten' (view as (size(0), -1), e.g. convolutions)"
            if p.ndim > 2
            else "optimize 0-D/1-D, embedding and output parameters with AdamW"
        )
        return (
            f"{type(self).__name__} only supports 2-D parameters with nd_mode='error'; {where} has shape "
            f"{tuple(p.shape)} ({hint})"
        )

    def _check_param(self, p: torch.Tensor, nd_mode: str, where: str) -> None:
        if not_a_matrix(p, nd_mode):
            raise ValueError(self._not_a_matrix_message(p, where))
        if not p.is_floating_point():
            raise ValueError(f"{where} must be a floating-point tensor, got {p.dtype}")
        if p.ndim > 2:
            t = p.to_local() if is_dtensor(p) else p
            dims = range(t.ndim) if nd_mode == "flatten" else range(t.ndim - 2)
            # The matrix view must share the param's memory (the update is written through it).
            try:
                t.view(batched_matrix_shape(tuple(t.shape), nd_mode))  # explicit sizes: an empty shard has no -1
            except RuntimeError:
                raise ValueError(
                    f"{where} of shape {tuple(p.shape)} and strides {t.stride()} cannot be viewed as matrices with "
                    f"nd_mode={nd_mode!r} (dims {list(dims)} must be contiguous)"
                ) from None

    def _step_keys(self) -> tuple[str, ...]:
        """The per-step values of a param group the ops read as device tensors."""
        adaptive = self._config.moment2_method is not None
        return ("lr", "weight_decay", "momentum") + (("beta2", "eps") if adaptive else ())

    def _group_config(self, group: dict) -> OrthogonalizationConfig:
        """How the matrices of ``group`` are orthogonalized: the optimizer's settings. A front end whose
        param groups carry their own Newton–Schulz settings (torch.optim.Muon's) overrides it."""
        return self._config

    def _group_configs(self) -> tuple[OrthogonalizationConfig, ...]:
        return tuple(self._group_config(group) for group in self.param_groups)

    def _rebuild_plan(self, agree_ranks: bool = True) -> None:
        # DTensor params: every rank of their meshes builds the same plan or raises the same error
        # (a refusal or plan seen by some ranks only would leave the others in a collective).
        agree_ranks = agree_ranks and getattr(self, "_agree_ranks", True)
        meshes = meshes_of(p for g in self.param_groups for p in g["params"]) if agree_ranks else []
        if meshes:
            # Options, param groups and parameters first: a parameter more on one rank must not reach
            # the plan build's own collectives (the shard sizes' gather) unpaired.
            agree(meshes, None, what=type(self).__name__, fields=self._agreement_fields())
        plan, error = None, None
        try:
            if meshes:  # a copy's rebuild (no collectives) keeps the shards' sizes its original gathered
                self._uneven_shards = uneven_splits([p for g in self.param_groups for p in g["params"]])
            uneven = self.__dict__.get("_uneven_shards") or []
            self._replica_work_in_use = resolve_replica_work(
                self.replica_work, self.sharded_mode, self.param_groups, self.nd_mode, self._config.precision,
                self._config.num_ns_steps)
            plan = build_plan(self.param_groups, self._config, self._tp_layout, self._split_shapes_of, self.nd_mode,
                              self.sharded_mode, self._group_configs(), self._gtp_layout, self._replica_work_in_use,
                              uneven, home_fn=self._home_domain)
            if self.block_period is not None and any(e.spans_ranks and e.split is not None for e in plan.entries):
                raise ValueError(
                    f"block_period={self.block_period} (MuonBP) orthogonalizes a shard as one matrix, which a fused "
                    "projection split into parts (split_shapes) sharded across ranks is not: use block_period=None")
            if self._low_memory_state and any(e.sharding is not None and e.sharding.uneven for e in plan.entries):
                raise ValueError(
                    f"state_dtype={self.state_dtype!r} lays its codes' blocks out by DTensor's chunking rule, which "
                    "some parameters' shards do not follow (Megatron-FSDP's uneven shards): use state_dtype='fp32'"
                )
            plan.chunks = chunk_entries(plan, workspace_budget_bytes(self._workspace_mib, plan))
        except (ValueError, TypeError) as exc:
            if not meshes:
                raise
            error = exc
        # Megatron's tensor-parallel (and GTP) groups: their ranks agree here on the fields and the plan.
        groups = [] if plan is None or not agree_ranks else [s for s in step_meshes(plan) if isinstance(s, GroupScope)]
        agree(meshes + groups, error, b"" if plan is None else plan_digest(plan), type(self).__name__,
              fields=self._agreement_fields() if groups else ())
        hyper = {}
        for bucket in plan.buckets:
            if self._low_memory_state and bucket.device not in self._state_seeds:
                # The stochastic rounding's seed, advanced on the device every step.
                self._state_seeds[bucket.device] = torch.zeros((), dtype=torch.int64, device=bucket.device)
            key = (bucket.group_index, bucket.device)
            if key not in hyper:
                # fp64: the kernels round e.g. 1 - momentum as the reference's Python floats do.
                # One dimension, handed to the ops as 0-dim views made inside the step: torch.compile
                # gives a 0-dim fp64 CPU tensor input a float symbol of its own, and torch 2.14 keeps
                # the ids of such unused symbols as "specialize" for the rest of the process, so a
                # group's Python-float lr whose id collides becomes a constant of the graph and the
                # step recompiles whenever the schedule changes it.
                hyper[key] = {
                    k: torch.zeros(1, dtype=torch.float64, device=bucket.device) for k in self._step_keys()
                }
        self._plan, self._hyper = plan, hyper
        overlap = self.__dict__.get("_overlap")
        if overlap is not None:
            overlap.sync_hooks(plan)

    # ------------------------------------------------------------------ workspace budget
    @property
    def workspace_mib(self) -> float | str | None:
        """The step's workspace budget in MiB: matrices are stepped in chunks whose Newton–Schulz
        buffers (inputs, outputs, iterates) fit it together, so a step's transient memory does not
        grow with the number of matrices; a matrix larger than the budget is stepped alone.
        ``"auto"`` (default): 256 MiB on GPUs, 64 MiB when every matrix is on the CPU. None: one
        chunk (every same-shape matrix in one Newton–Schulz call). Settable at any time."""
        return self._workspace_mib

    @workspace_mib.setter
    def workspace_mib(self, value: float | str | None) -> None:
        self._workspace_mib = check_workspace_mib(value)
        if getattr(self, "_plan", None) is not None:
            self._plan.chunks = chunk_entries(self._plan, workspace_budget_bytes(self._workspace_mib, self._plan))

    def _current_plan(self) -> Plan:
        plan = self._plan
        if plan is None or not self._plan_is_current(plan):
            self._rebuild_plan()  # params were added, removed or swapped in a group: regroup once
            plan = self._plan
        return plan

    def _plan_is_current(self, plan: Plan) -> bool:
        """True while the groups hold the params the plan was built for (a front end whose groups
        carry settings also compares those)."""
        return _plan_matches(plan, self.param_groups)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step. ``closure`` is not supported (as in Emerging-Optimizers)."""
        if closure is not None:
            raise ValueError("closure is not supported")
        return self._run_step()

    @records_step_stats
    def _run_step(self) -> None:
        """The step itself, without torch's step hooks (``step`` is wrapped with them per class, so a
        front end with its own ``step`` calls this rather than ``super().step``)."""
        overlap = self.__dict__.get("_overlap")
        if overlap is not None and overlap.work is not None and overlap.work.off:
            overlap.work = None  # backward started nothing: this step does it all
        if (self._ride_ticket is not None and not torch.compiler.is_compiling()
                and not capturing_cuda_graph(self._plan) and self._ride()):
            return None  # (step.ride: rode the ticket; on a fallback every rank goes on to the ordinary step)
        error = self._step_time_error() or self._spanning_matrix_error()
        overlapped = overlap is not None and overlap.work is not None
        fused = self._use_fused_step()
        plan = self._current_plan() if self._config is not None else None
        engine = self.__dict__.get("_engine")
        active = None
        if plan is not None and fused and not overlapped:
            active = [e.param.grad is not None for e in plan.entries]
            if error is None:
                # Everything that can reject the input runs before anything is written.
                try:
                    self._check_grads(plan, active)
                    self._write_hyperparameters(plan, active)
                except (ValueError, TypeError, RuntimeError) as exc:
                    error = exc
        agreed = False
        if plan is not None and not overlapped:  # (an overlapped step agreed when backward began it)
            try:
                agreed = self._agree_step(plan, active, error)
            except BaseException:
                if overlap is not None:
                    overlap.discard(None)  # (backward started nothing: it checked the same)
                raise
        if error is not None:
            if overlap is not None:
                overlap.discard(None)
            raise error
        if not fused:
            if self._low_memory_state:
                raise RuntimeError(
                    f"state_dtype={self.state_dtype!r} is stepped by the fused ops, but {type(self).__name__} "
                    f"overrides {sorted(self.overridden_extension_points()) or 'scaled_orthogonalize_fn'}, which "
                    "steps each parameter with fp32 state: construct it with state_dtype='fp32'"
                )
            return self._hook_step()
        if overlapped:  # backward began the step (step.overlap finishes it with the same engine)
            self._finish_overlapped_step(overlap)
            return None
        run = engine.begin(plan, optimizer=self)  # (step.engine: the one step, plain or overlapped with backward)
        first = None if torch.compiler.is_compiling() else self._record_first_exchange(agreed)
        run.run_chunks(active)  # the matrices whose buffers fit the workspace budget together, in plan order
        run.finish()
        if not torch.compiler.is_compiling():
            self._end_ride_record(first, plan, active)
        return None

    @torch._disable_dynamo
    def _finish_overlapped_step(self, overlap: BackwardOverlap) -> None:
        overlap.finish()

    # ------------------------------------------------------------------ overlap with backward
    def accumulating(self):
        """A context manager for plain gradient-accumulation loops with ``overlap_backward=True``:
        the backward passes inside it are non-final micro-batches and start no optimizer work
        (FSDP2 needs none: it calls no hook while ``set_requires_gradient_sync(False)``)."""
        overlap = self.__dict__.get("_overlap")
        if overlap is None:
            return contextlib.nullcontext()
        return overlap.accumulating()

    def overlap_with_ddp(self, ddp_module) -> None:
        """With ``overlap_backward=True`` under ``DistributedDataParallel`` (constructed with
        ``gradient_as_bucket_view=True``): registers a DDP comm hook that averages each bucket as
        DDP does and starts the optimizer work of its matrices when it is reduced (a post-accumulate
        hook would see the gradient before its all-reduce). ``no_sync()`` micro-batches start nothing."""
        overlap = self.__dict__.get("_overlap")
        if overlap is None:
            raise ValueError(f"{type(self).__name__}.overlap_with_ddp needs overlap_backward=True")
        overlap.attach_ddp(ddp_module)

    def zero_grad(self, set_to_none: bool = True) -> None:
        overlap = self.__dict__.get("_overlap")
        if overlap is not None and overlap.work is not None:
            overlap.discard("zero_grad() before step()")
        super().zero_grad(set_to_none)

    @torch._disable_dynamo
    def state_dict(self) -> dict[str, Any]:
        self._wait_for_overlap()
        state_dict = super().state_dict()
        if self.block_period is not None:  # MuonBP's phase: a resumed run takes its full steps where it would
            state_dict[BLOCK_STEPS_KEY] = self._block_steps
        return state_dict

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        overlap = self.__dict__.get("_overlap")
        if overlap is not None:
            overlap.discard(None)  # the checkpoint replaces the state the work wrote
        steps = state_dict.get(BLOCK_STEPS_KEY)
        if BLOCK_STEPS_KEY in state_dict:
            state_dict = {k: v for k, v in state_dict.items() if k != BLOCK_STEPS_KEY}
        super().load_state_dict(state_dict)
        if steps is not None and self.block_period is not None:
            self._block_steps = int(steps)

    def _spanning_matrix_error(self) -> Exception | None:
        """What cannot run on a matrix sharded across ranks (a DTensor the sharded path orthogonalizes
        whole on an owner), refused before anything changes rather than computed on the local shard:
        a weight-update hook (its norms would be the shard's) and an ``orthogonalize`` override (it
        would receive the shard)."""
        if self._config is None:
            return None
        spanning = next((e for e in self._current_plan().entries if e.spans_ranks), None)
        if spanning is None:
            return None
        where = f"the {tuple(spanning.param.shape)} matrix sharded across ranks"
        if _effective_hook(self._weight_update_hook) is not None:
            return ValueError(
                f"weight_update_hook {type(self._weight_update_hook).__name__} takes whole-matrix norms, which "
                f"{type(self).__name__} does not compute for {where}: use it with unsharded or replicated parameters"
            )
        if not self._orthogonalize_is_base():
            return ValueError(
                f"{type(self).__name__} overrides orthogonalize(), which would receive the local shard of {where}: "
                "an override runs with unsharded or replicated parameters only"
            )
        return None

    # ------------------------------------------------------------------ Emerging-Optimizers' extension point
    def _orthogonalize_is_base(self) -> bool:
        return type(self).orthogonalize is OrthogonalizedOptimizer.orthogonalize

    def orthogonalize(self, p: torch.Tensor, grad: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """The orthogonalized update of ``p`` from ``grad`` (its Newton–Schulz input), as ``step`` uses it.

        Emerging-Optimizers' semantics: Muon returns the scaled update (``scale_mode`` ×
        ``extra_scale_factor``, QKV parts scaled separately), AdaptiveMuon the raw Newton–Schulz
        output (normalized and scaled afterwards). ``kwargs`` are the param group's settings.
        Subclasses override it (conv reshapes, custom splits) and may call ``super().orthogonalize``
        for the parameters they leave alone: during ``step`` that returns the batched result.
        With a ``scaled_orthogonalize_fn`` of the caller's (EO-style construction, or one assigned
        later), it is called on the 2-D ``grad``, as in EO.
        """
        if not isinstance(self.scaled_orthogonalize_fn, FusedScaledOrthogonalize) or self._config is None:
            if grad.ndim != 2:
                raise ValueError("Only 2D parameters are supported.")
            return self.scaled_orthogonalize_fn(grad)
        batched = self._batched
        if batched is not None:
            hit = batched.get(id(p))
            if hit is not None and hit[0] is grad:
                return hit[1]
        plan = self._current_plan()
        index = plan.index.get(id(p))
        entry = None if index is None else plan.entries[index]
        if entry is None or tuple(grad.shape) != entry.local_shape:
            if grad.ndim != 2:
                raise ValueError(f"orthogonalize: only 2-D updates are supported, got shape {tuple(grad.shape)}")
            # a tensor this optimizer does not hold
            out = self._config.newton_schulz(grad.to(torch.float32).unsqueeze(0))[0]
            return out if self._config.moment2_method is not None else out * self._config.scale(*grad.shape)
        x = grad.to(torch.float32)
        if entry.spans_ranks and _whole_matrix(grad, entry):
            # The whole matrix, gathered by a caller that owns it (Megatron-FSDP's FsdpMuon runs this on
            # the owner alone): orthogonalized here, no collective.
            cfg = plan.configs[entry.group_index]
            whole = x.unsqueeze(0).contiguous()
            out = (cfg.newton_schulz(whole) if entry.split is None
                   else split_newton_schulz(cfg, whole, entry.split, cfg.moment2_method is None))[0]
        elif entry.spans_ranks:
            # A matrix spanning ranks: a collective, so every rank of its mesh must call this.
            out = self._sharded.run([entry.sharding], [x.contiguous()], plan.configs[entry.group_index],
                                    [entry.split])[0]
        else:
            res = self._orthogonalize(plan.stacks[entry.stack_index], x if x.ndim == 3 else x.unsqueeze(0))
            out = res[0] if x.ndim == 2 else (res if isinstance(res, torch.Tensor) else torch.stack(res))
        return out if self._config.moment2_method is not None else out * entry.update_scale

BLOCK_STEPS_KEY = "block_period_steps"  # MuonBP's step count in a state_dict (step.block_periodic)

# The fused step reproduces these methods; a subclass replacing one gets the per-parameter step.
OrthogonalizedOptimizer._fused_hook_defaults = {name: getattr(OrthogonalizedOptimizer, name) for name in BASE_HOOK_NAMES}



def _whole_matrix(grad: torch.Tensor, entry) -> bool:
    """Whether ``grad`` is the whole matrix of a parameter sharded across ranks (a plain tensor of its
    global shape), not this rank's shard of it."""
    return (not is_dtensor(grad) and grad.ndim == 2 and len(entry.local_shape) == 2
            and tuple(grad.shape) == tuple(entry.global_shape))


def _effective_hook(hook):
    """The weight-update hook a step must call: None for none or the no-op one."""
    return None if hook is None or isinstance(hook, NoOpWeightUpdateHook) else hook


def _plan_matches(plan: Plan, param_groups) -> bool:
    """True when the groups still hold exactly the parameters the plan was built for, in order."""
    if plan.group_sizes != tuple(len(g["params"]) for g in param_groups):
        return False
    params = plan.params
    i = 0
    for group in param_groups:
        for p in group["params"]:
            if params[i] is not p:
                return False
            i += 1
    return True
