"""The fused step shared by Muon, AdaptiveMuon and their tensor-parallel variants.

Per step, with the parameters grouped once (see ``_plan``), for each *chunk* (the matrices whose
Newton–Schulz buffers fit the workspace budget ``workspace_mib`` together; small models are one
chunk, a large matrix is a chunk of its own, so the step's transient memory is bounded by the
budget or by the largest matrix, not by the size of the model):

1. per bucket (param group, dtype, device): one ``foreach_momentum_`` — momentum EMA, L2 decay,
   Nesterov — writing the Newton–Schulz inputs straight into a stacked fp32 (k, m, n) buffer per
   stack (views of one flat buffer per device, reused by every chunk of the step);
2. per stack: one batched ``newton_schulz`` (QKV projections: ``newton_schulz_split``; tensor
   parallel: see ``_distributed``);
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

The class has Emerging-Optimizers 0.4's constructor (``lr, momentum, weight_decay, nesterov,
weight_decay_method, fp32_matmul_prec, scaled_orthogonalize_fn``, plus EO main's
``weight_update_hook``) for EO-style subclasses, which take the per-parameter step; the fused
classes (Muon, AdaptiveMuon, Scion, the tensor-parallel ones) set up through ``_init_fused``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .. import ops
from ._config import OrthogonalizationConfig, check_group_hyperparameters, check_matmul_precision, check_step_value
from ._eo_hooks import BASE_HOOK_NAMES, EOExtensionPoints, FusedScaledOrthogonalize
from .weight_update_hooks import NoOpWeightUpdateHook
from ._distributed import (
    distributed_orthogonalize,
    gather_shards,
    local_chunk,
    tp_namo_normalize_,
    tp_normuon_normalize_,
)
from ._plan import (
    DEFAULT_WORKSPACE_MIB,
    Plan,
    QKVSplit,
    Stack,
    TPLayout,
    build_plan,
    check_workspace_mib,
    chunk_entries,
    not_a_matrix,
)
from ._sharded import (
    ND_MODES,
    SHARDED_MODES,
    ShardedOrthogonalizer,
    describe,
    is_dtensor,
    local,
    sharded_namo_,
    sharded_normuon_,
    zeros_state,
)
from ._state_check import check_loaded_state
from . import _low_memory
from .. import low_memory_state as lms
from ..second_moment import moment2_view_shape


class OrthogonalizedOptimizer(EOExtensionPoints, torch.optim.Optimizer):
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

    # Low-memory state (see megatron_eopt.low_memory_state): set by the fused classes' constructors.
    state_dtype = "fp32"
    state_block_size = lms.DEFAULT_BLOCK_SIZE

    # Emerging-Optimizers 0.4's timing of the errors above; the tensor-parallel classes keep
    # refusing at construction, as before (Megatron-LM never hands them such parameters).
    _eo_step_time_errors = True
    _nd_error_type: type = ValueError  # Muown: TypeError, as EO's
    _nd_error_without_grad = False  # AdaptiveMuon: True (EO checks every param before its grad)
    _momentum_below_one = True  # torch.optim.Muon's front end: any momentum >= 0
    _workspace_mib: float | None = DEFAULT_WORKSPACE_MIB  # see the workspace_mib property

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

    @property
    def fp32_matmul_prec(self) -> str:
        """Precision of the Newton–Schulz products: "medium" (bf16), "high" (TF32) or "highest" (fp32).
        One home: the fused configuration's ``precision`` (an attribute only for an EO-style
        optimizer without one). Set after construction, the fused step follows it too
        (Emerging-Optimizers reads the attribute at each step)."""
        config = self.__dict__.get("_config")
        return config.precision if config is not None else self.__dict__["_fp32_matmul_prec"]

    @fp32_matmul_prec.setter
    def fp32_matmul_prec(self, value: str) -> None:
        check_matmul_precision(value)
        config = self.__dict__.get("_config")
        if config is None:
            self.__dict__["_fp32_matmul_prec"] = value
        elif config.precision != value:
            self._use_config(dataclasses.replace(config, precision=value))

    def _use_config(self, config: OrthogonalizationConfig) -> None:
        """Makes ``config`` the optimizer's, with everything built from it (the plan is rebuilt)."""
        self._config = config
        self.scaled_orthogonalize_fn = FusedScaledOrthogonalize(config, scaled=config.moment2_method is None)
        self._sharded = ShardedOrthogonalizer(config)
        if self._constructed:
            self._rebuild_plan()

    def _init_fused(self, params, defaults: dict, config: OrthogonalizationConfig, *, nd_mode: str = "error",
                    sharded_mode: str = "owner", weight_update_hook: Any | None = None, state_dtype: str = "fp32",
                    state_block_size: int = lms.DEFAULT_BLOCK_SIZE, workspace_mib: float | None = DEFAULT_WORKSPACE_MIB,
                    deferred_error: tuple[str, type, str] | None = None) -> None:
        """Sets up the fused step: ``config`` says how every parameter is orthogonalized; ``state_dtype``
        and ``state_block_size`` how its state is stored (:mod:`megatron_eopt.low_memory_state`);
        ``workspace_mib`` bounds a step's transient memory (the ``workspace_mib`` property).
        ``deferred_error`` (``_config.defer_step_time_errors``) is what ``step()`` raises."""
        self.state_dtype = lms.validate_state_dtype(state_dtype)
        self.state_block_size = lms.validate_block_size(state_block_size)
        self._workspace_mib = check_workspace_mib(workspace_mib)
        self._state_seeds: dict[torch.device, torch.Tensor] = {}
        self._deferred_error = deferred_error
        self._weight_update_hook = _effective_hook(weight_update_hook)
        if nd_mode not in ND_MODES:
            raise ValueError(f"nd_mode must be one of {list(ND_MODES)}, got {nd_mode!r}")
        if sharded_mode not in SHARDED_MODES:
            raise ValueError(f"sharded_mode must be one of {list(SHARDED_MODES)}, got {sharded_mode!r}")
        self.nd_mode = nd_mode
        self.sharded_mode = sharded_mode
        self._constructed = False
        self._use_config(config)
        self.__dict__.pop("_fp32_matmul_prec", None)  # the configuration holds it from now on
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

    def _qkv_split_sizes(self, p: torch.Tensor) -> list[int] | None:
        """Split sizes when p is a fused QKV projection to orthogonalize per part."""
        return None

    # ------------------------------------------------------------------ param groups and plan
    @torch._disable_dynamo
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self._config is None:  # EO-style: parameters are checked where EO checks them, at step()
            return
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        try:
            nd_mode = group.get("nd_mode", self.nd_mode)
            if nd_mode not in ND_MODES:
                raise ValueError(f"param_groups[{gi}]['nd_mode'] must be one of {list(ND_MODES)}, got {nd_mode!r}")
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
                    describe(p, nd_mode, self.sharded_mode, where)  # rejects Partial and impossible views
                    _low_memory.check_sharding(p, self.state_dtype, where)
            check_group_hyperparameters(group, f"param_groups[{gi}]", self._momentum_below_one)
            if self._constructed:
                self._rebuild_plan()
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
                t.view(t.shape[0], -1) if nd_mode == "flatten" else t.view(-1, *t.shape[-2:])
            except RuntimeError:
                raise ValueError(
                    f"{where} of shape {tuple(p.shape)} and strides {t.stride()} cannot be viewed as matrices with "
                    f"nd_mode={nd_mode!r} (dims {list(dims)} must be contiguous)"
                ) from None

    # Pickling, copying and loading rebuild the plan: they run outside dynamo (as torch.optim's own
    # state_dict, load_state_dict and add_param_group do), so an optimizer copied or loaded inside
    # a compiled function is complete.
    @torch._disable_dynamo
    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles defaults, state and param_groups only; the settings kept on
        # the instance go along (copy.deepcopy, pickle), the plan is rebuilt on the other side.
        state = super().__getstate__()
        transient = ("_plan", "_hyper", "_batched", "_sharded", "_state_seeds")
        state.update({k: v for k, v in self.__dict__.items() if k not in state and k not in transient})
        return state

    @torch._disable_dynamo
    def __setstate__(self, state: dict[str, Any]) -> None:
        if "fp32_matmul_prec" in state:  # pickled before the attribute became a property
            precision = state.pop("fp32_matmul_prec")
            if state.get("_config") is None:
                state["_fp32_matmul_prec"] = precision
        super().__setstate__(state)
        self._batched = None
        if self._config is None:
            return
        self._sharded = ShardedOrthogonalizer(self._config)
        if not hasattr(self, "_state_seeds"):
            self._state_seeds = {}
        # Param groups keep exactly the keys they were saved with (state_dict -> load_state_dict
        # -> state_dict is the identity, as with Emerging-Optimizers' classes). Only a per-step
        # value the step reads and the loaded group lacks (e.g. beta2 / eps in a group saved by a
        # class without a second moment) is filled from our defaults. torch's own bookkeeping
        # defaults (torch.optim.Optimizer.__setstate__ adds differentiable=False) never reach a group.
        defaults = getattr(self, "defaults", {})
        for group in self.param_groups:
            for key in self._step_keys():
                if key not in group and key in defaults:
                    group[key] = defaults[key]
        for param_state in self.state.values():
            # load_state_dict casts state to the param's dtype; the second moment stays fp32
            m2 = param_state.get("moment2_buffer") if isinstance(param_state, dict) else None
            if m2 is not None and m2.dtype != torch.float32:
                param_state["moment2_buffer"] = m2.float()
        if getattr(self, "_constructed", False):
            self._rebuild_plan()

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Low-memory entries are converted to this optimizer's state_dtype first (they bypass torch's
        # cast to the parameter's dtype); every misfit is refused before anything changes.
        held = {}
        if self._config is not None:
            state_dict, held = _low_memory.split_state_dict(self, state_dict, self._low_memory_target)
        check_loaded_state(self, state_dict)
        super().load_state_dict(state_dict)
        _low_memory.restore(self, state_dict, held, self._state_seeds if self._config is not None else None)

    def state_dict(self) -> dict[str, Any]:
        # Low-memory state also saves the stochastic rounding's seed and its format version (see
        # _low_memory): a resumed run draws what the uninterrupted one would have.
        state_dict = super().state_dict()
        if self._config is not None and self.state_dtype != "fp32":
            state_dict = _low_memory.add_resume_entries(state_dict, self.param_groups, self._state_seeds)
        return state_dict

    def _low_memory_target(self, p: torch.Tensor):
        """(state_dtype, block size, keys that follow it) for a parameter of this optimizer."""
        keys = (_low_memory.MOMENTUM,) + ((_low_memory.MOMENT2,) if self._config.moment2_method == "adamuon" else ())
        return self.state_dtype, self.state_block_size, keys

    def _expected_state(self, p: torch.Tensor, key: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """What ``load_state_dict`` accepts for ``state[p][key]``: (shape, dtype), or None (not checked)."""
        if key == "momentum_buffer":
            return tuple(p.shape), p.dtype
        method = self._config.moment2_method
        if key != "moment2_buffer" or method is None:
            return None
        plan = self._current_plan()
        entry = plan.entries[plan.index[id(p)]] if id(p) in plan.index else None
        if entry is None or entry.sharding is not None:
            return None  # a DTensor's statistics: laid out by its sharding, checked by DCP's planner
        if method == "adamuon":  # elementwise: shaped like p (a flattened conv too)
            return tuple(p.shape), torch.float32
        return moment2_view_shape(method, entry.local_shape, entry.normuon_dim), torch.float32

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

    def _rebuild_plan(self) -> None:
        plan = build_plan(self.param_groups, self._config, self._tp_layout, self._qkv_split_sizes, self.nd_mode,
                          self.sharded_mode, self._group_configs())
        hyper = {}
        for bucket in plan.buckets:
            if self.state_dtype != "fp32" and bucket.device not in self._state_seeds:
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
        plan.chunks = chunk_entries(plan, self._workspace_bytes())
        self._plan, self._hyper = plan, hyper

    # ------------------------------------------------------------------ workspace budget
    @property
    def workspace_mib(self) -> float | None:
        """The step's workspace budget in MiB: matrices are stepped in chunks whose Newton–Schulz
        buffers (inputs, outputs, iterates) fit it together, so a step's transient memory does not
        grow with the number of matrices; a matrix larger than the budget is stepped alone. None:
        one chunk (every same-shape matrix in one Newton–Schulz call). Settable at any time."""
        return self._workspace_mib

    @workspace_mib.setter
    def workspace_mib(self, value: float | None) -> None:
        self._workspace_mib = check_workspace_mib(value)
        if getattr(self, "_plan", None) is not None:
            self._plan.chunks = chunk_entries(self._plan, self._workspace_bytes())

    def _workspace_bytes(self) -> float | None:
        return None if self._workspace_mib is None else self._workspace_mib * 2**20

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

    # ------------------------------------------------------------------ state
    def _init_entry_state(self, index: int) -> None:
        entry = self._plan.entries[index]
        p = entry.param
        state = self.state[p]
        method = self._config.moment2_method
        if "momentum_buffer" not in state:
            if self.state_dtype != "fp32":
                state.update(_low_memory.new_state(p, "momentum_buffer", self.state_dtype, self.state_block_size))
            else:
                # A DTensor param gets a DTensor state with its mesh and placements (DCP reshards it).
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if method == "adamuon" and self.state_dtype != "fp32" and "moment2_buffer" not in state:
            state.update(_low_memory.new_state(p, "moment2_buffer", self.state_dtype, self.state_block_size))
        if method is not None and "moment2_buffer" not in state:
            # fp32 whatever p's dtype (the normalization ops keep their statistics in fp32; for
            # fp32 params this is Emerging-Optimizers' layout, which stores p's dtype).
            # nd_mode "batch": one statistic per matrix, (E, m, 1) / (E, 1, n) / (E, 1).
            view = entry.local_shape if entry.sharding is None else entry.sharding.view_shape
            shape = moment2_view_shape(method, view, entry.normuon_dim)
            if entry.sharding is None:
                if method == "adamuon":
                    shape = tuple(p.shape)  # elementwise: shaped like p (a flattened conv too)
                state["moment2_buffer"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            elif method == "adamuon":  # elementwise: sharded exactly like p
                state["moment2_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            else:
                state["moment2_buffer"] = zeros_state(p, entry.sharding, shape, torch.float32)

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates the state of every parameter, with or without a grad (before loading a checkpoint)."""
        if self._config is None:
            for group in self.param_groups:
                self._init_group(group, skip_non_grad_params=False)
            return
        plan = self._current_plan()
        self._check_state_creation(plan, plan.params)
        for i in range(len(plan.entries)):
            self._init_entry_state(i)

    @torch.no_grad()
    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        """Emerging-Optimizers' state initializer (Megatron's init_state_fn calls it)."""
        if self._config is None:
            return EOExtensionPoints._init_group(self, group, skip_non_grad_params)
        plan = self._current_plan()
        params = [p for p in group["params"] if not (skip_non_grad_params and p.grad is None)]
        self._check_state_creation(plan, params)
        for p in params:
            self._init_entry_state(plan.index[id(p)])

    # ------------------------------------------------------------------ errors at step(), as EO raises them
    def _step_time_error(self, at_construction: bool = False) -> Exception | None:
        """The error ``step()`` raises before touching anything (None: none), in EO 0.4's terms: an
        argument it checks when a step first uses it (once any param has a gradient), then the first
        param that is not a matrix (with a gradient, or any for AdaptiveMuon). ``at_construction``:
        the same, gradients or not (for wrappers that validate their inner optimizer up front)."""
        if self._config is None:
            return self._eo_style_step_error()
        plan = self._current_plan()
        if self._deferred_error is None and not plan.rejected:
            return None
        has_grad = at_construction or any(p.grad is not None for g in self.param_groups for p in g["params"])
        if self._deferred_error is not None and has_grad:
            _, exc_type, message = self._deferred_error
            return exc_type(message)
        for gi, pi in plan.rejected:
            group = self.param_groups[gi]
            p = group["params"][pi]
            if at_construction or self._nd_error_without_grad or p.grad is not None:
                return self._nd_error_type(self._not_a_matrix_message(p, f"param_groups[{gi}]['params'][{pi}]"))
        return None

    def _eo_style_step_error(self) -> Exception | None:
        """What an EO-style optimizer (caller's ``scaled_orthogonalize_fn``) would refuse midway through
        its loop, refused before anything changes: a deferred argument, an unknown weight-decay method
        (while ``_apply_weight_decay_inplace`` is EO's), a param that is not a matrix (while
        ``orthogonalize`` is the base one; an override may handle N-D params, as EO says)."""
        active = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                  if p.grad is not None]
        if not active:
            return None
        if self._deferred_error is not None:
            _, exc_type, message = self._deferred_error
            return exc_type(message)
        cls = type(self)
        method = getattr(self, "weight_decay_method", "l2")
        if (cls._apply_weight_decay_inplace is EOExtensionPoints._apply_weight_decay_inplace
                and method not in EO_WEIGHT_DECAY_METHODS
                and any(_nonzero(self.param_groups[gi]["weight_decay"]) for gi, _, _ in active)):
            return ValueError(f"Invalid weight decay method: {method} (expected one of "
                              f"{', '.join(EO_WEIGHT_DECAY_METHODS)})")
        if cls.orthogonalize is OrthogonalizedOptimizer.orthogonalize:
            for gi, pi, p in active:
                if p.ndim != 2:
                    return ValueError(
                        f"Only 2D parameters are supported: param_groups[{gi}]['params'][{pi}] has shape "
                        f"{tuple(p.shape)}"
                    )
        return None

    def _check_state_creation(self, plan: Plan, params) -> None:
        """Refuses to create state that EO would refuse: params that are not matrices, or any state
        while moment2_method (which decides the state's layout) is unknown."""
        params = list(params)
        if not params:
            return
        if self._deferred_error is not None and self._deferred_error[0] == "moment2_method":
            _, exc_type, message = self._deferred_error
            raise exc_type(message)
        for p in params:
            if id(p) not in plan.index:
                gi, pi = next((gi, pi) for gi, g in enumerate(self.param_groups) for pi, q in enumerate(g["params"])
                              if q is p)
                raise self._nd_error_type(self._not_a_matrix_message(p, f"param_groups[{gi}]['params'][{pi}]"))

    # ------------------------------------------------------------------ step
    def _check_grads(self, plan: Plan, active: list[bool]) -> None:
        for i, entry in enumerate(plan.entries):
            if not active[i]:
                continue
            p, g = entry.param, entry.param.grad
            if g.is_sparse:
                raise ValueError(
                    f"{type(self).__name__} does not support sparse gradients (param of shape {tuple(p.shape)})"
                )
            if is_dtensor(p) and (not is_dtensor(g) or g.placements != p.placements or g.device_mesh != p.device_mesh):
                raise ValueError(
                    f"grad of a DTensor param of shape {tuple(p.shape)} with placements {list(p.placements)} must be a "
                    f"DTensor on the same mesh and placements, got "
                    f"{list(g.placements) if is_dtensor(g) else type(g).__name__}"
                )
            if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise ValueError(
                    f"grad of a param of shape {tuple(p.shape)}, {p.dtype} on {p.device} must match it, got "
                    f"shape {tuple(g.shape)}, {g.dtype} on {g.device}"
                )

    def _write_hyperparameters(self, plan: Plan, active: list[bool]) -> None:
        """Checks the per-step values of the groups in use, then writes them to the device tensors."""
        groups_used = {plan.entries[i].group_index for i in range(len(plan.entries)) if active[i]}
        keys = self._step_keys()
        for gi in sorted(groups_used):
            group = self.param_groups[gi]
            for key in keys:
                check_step_value(key, group[key], f"param_groups[{gi}]", self._momentum_below_one)
        if not torch.compiler.is_compiling() and _capturing_cuda_graph(plan):
            # A host value (Python number or CPU tensor) is written into the graph as a constant.
            # That is what a constant momentum or weight decay wants, but a learning rate is
            # scheduled: a captured host lr would replay its capture-time value forever.
            for gi in sorted(groups_used):
                if _host_value(self.param_groups[gi]["lr"]) is not None:
                    raise RuntimeError(
                        f"param_groups[{gi}]['lr'] is a Python number while a CUDA graph is being captured: "
                        "the graph would replay the value it had at capture time. Store it as a 0-dim tensor "
                        f"on the device (param_groups[{gi}]['lr'] = torch.tensor(value, device='cuda')) and "
                        "update it in place between replays (other per-step values given as numbers are "
                        "captured as constants)."
                    )
        for (gi, _device), tensors in self._hyper.items():
            if gi in groups_used:
                group = self.param_groups[gi]
                for key, buf in tensors.items():
                    _write_scalar(buf, group[key])

    def _momentum_grad_divisor(self, hyper: dict[str, torch.Tensor], grad_scale: torch.Tensor | None):
        """What the momentum op divides the gradients by: GradScaler's scale (None: nothing).
        A subclass may fold a per-group factor in (``hyper`` holds the group's device scalars),
        e.g. ``1 - momentum`` for an SGD-style buffer ``buf = momentum·buf + g``."""
        return grad_scale

    def _grad_scaler_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """GradScaler's grad_scale and found_inf, set on the optimizer for the duration of step()."""
        return getattr(self, "grad_scale", None), getattr(self, "found_inf", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step. ``closure`` is not supported (as in Emerging-Optimizers)."""
        if closure is not None:
            raise ValueError("closure is not supported")
        return self._run_step()

    def _run_step(self) -> None:
        """The step itself, without torch's step hooks (``step`` is wrapped with them per class, so a
        front end with its own ``step`` calls this rather than ``super().step``)."""
        error = self._step_time_error()
        if error is not None:
            raise error
        if not self._use_fused_step():
            if self.state_dtype != "fp32":
                raise RuntimeError(
                    f"state_dtype={self.state_dtype!r} is stepped by the fused ops, but {type(self).__name__} "
                    f"overrides {sorted(self.overridden_extension_points()) or 'scaled_orthogonalize_fn'}, which "
                    "steps each parameter with fp32 state: construct it with state_dtype='fp32'"
                )
            return self._hook_step()
        plan = self._current_plan()
        active = [e.param.grad is not None for e in plan.entries]
        # Everything that can reject the input runs before anything is written.
        self._check_grads(plan, active)
        self._write_hyperparameters(plan, active)
        for seed in self._state_seeds.values():  # new draws for the stochastic rounding of this step
            seed.add_(1)
        scalers = self._scaler_tensors_per_device(plan)
        chunks = [members for members in ([i for i in chunk if active[i]] for chunk in plan.chunks) if members]
        inputs = self._ns_input_buffers(plan, chunks)
        for members in chunks:  # the matrices whose buffers fit the workspace budget together
            ns_inputs, stacked = self._ns_input_views(plan, members, inputs)
            launches = self._momentum_phase(plan, members, ns_inputs, scalers)
            updates, scales = self._orthogonalize_phase(plan, members, ns_inputs, stacked)
            self._update_phase(plan, launches, updates, scales, ns_inputs)
        return None

    # The phases of one chunk. ``members`` are the chunk's entries with a grad; ``ns_inputs``,
    # ``updates`` and ``scales`` are dicts keyed by entry index.
    def _scaler_tensors_per_device(self, plan: Plan) -> dict:
        """GradScaler's (grad_scale, found_inf), one copy per device, as torch's fused optimizers do."""
        grad_scale, found_inf = self._grad_scaler_tensors()
        scalers: dict[torch.device, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        for bucket in plan.buckets:
            if bucket.device not in scalers:
                scalers[bucket.device] = (
                    None if grad_scale is None else grad_scale.to(bucket.device, non_blocking=True),
                    None if found_inf is None else found_inf.to(bucket.device, non_blocking=True),
                )
        return scalers

    @staticmethod
    def _ns_input_buffers(plan: Plan, chunks: list[list[int]]) -> dict[torch.device, torch.Tensor]:
        """One flat fp32 buffer per device, as large as the stacked NS inputs of the largest chunk:
        every chunk of the step writes its inputs into it (sharded matrices have their own)."""
        sizes: dict[torch.device, int] = {}
        for members in chunks:
            per_stack: dict[int, int] = {}
            for i in members:
                e = plan.entries[i]
                if e.stack_index >= 0:
                    per_stack[e.stack_index] = per_stack.get(e.stack_index, 0) + e.batch * e.local_shape[-2] * \
                        e.local_shape[-1]
            per_chunk: dict[torch.device, int] = {}
            for si, size in per_stack.items():
                device = plan.stacks[si].device
                per_chunk[device] = per_chunk.get(device, 0) + _aligned(size)
            for device, size in per_chunk.items():
                sizes[device] = max(sizes.get(device, 0), size)
        return {device: torch.empty(size, dtype=torch.float32, device=device) for device, size in sizes.items()}

    @staticmethod
    def _ns_input_views(plan: Plan, members: list[int], inputs: dict) -> tuple[dict, dict]:
        """The NS input of each member, and per stack its members with their (k, m, n) input: the
        stacks lie one after another in the device's flat buffer and each member's input is its slice
        (an nd_mode "batch" entry its E consecutive slices); a sharded matrix has its own local part."""
        entries = plan.entries
        ns_inputs: dict[int, torch.Tensor] = {}
        by_stack: dict[int, list[int]] = {}
        for i in members:
            if entries[i].stack_index >= 0:
                by_stack.setdefault(entries[i].stack_index, []).append(i)
            else:
                e = entries[i]
                ns_inputs[i] = torch.empty(e.local_shape, dtype=torch.float32, device=e.param.device)
        offsets: dict[torch.device, int] = {}
        stacked: dict[int, tuple[list[int], torch.Tensor]] = {}
        for si, stack_members in by_stack.items():
            stack = plan.stacks[si]
            rows, cols = stack.local_shape
            count = sum(entries[i].batch for i in stack_members)
            start = offsets.get(stack.device, 0)
            offsets[stack.device] = start + _aligned(count * rows * cols)
            buf = inputs[stack.device][start : start + count * rows * cols].view(count, rows, cols)
            stacked[si] = (stack_members, buf)
            slices = buf.unbind(0)  # one call for every matrix's view: the step's host time counts
            k = 0
            for i in stack_members:
                e = entries[i]
                ns_inputs[i] = slices[k] if len(e.local_shape) == 2 else buf[k : k + e.batch]
                k += e.batch
        return ns_inputs, stacked

    def _momentum_phase(self, plan: Plan, members: list[int], ns_inputs: dict, scalers: dict) -> list[tuple]:
        """1. Momentum (and L2 decay, Nesterov) per bucket, writing the NS inputs. Returns what the
        update phase needs per bucket."""
        entries = plan.entries
        # The chunk's members per bucket, in the bucket's (entry) order: a one-chunk step launches
        # exactly what an unchunked one does. Costs the chunk's size, not the model's.
        by_bucket: dict[int, list[int]] = {}
        for i in sorted(members):
            by_bucket.setdefault(entries[i].bucket_index, []).append(i)
        launches = []
        for bi in sorted(by_bucket):
            bucket, bucket_members = plan.buckets[bi], by_bucket[bi]
            for i in bucket_members:
                self._init_entry_state(i)
            group = self.param_groups[bucket.group_index]
            group_cfg = plan.configs[bucket.group_index]
            # The ops run on local matrix views (DTensor: to_local(); nd_mode: (E, m, n) or
            # (size(0), -1)); they take any dense layout (a transposed parameter and its
            # row-major NS input).
            params = [entries[i].view(entries[i].param) for i in bucket_members]
            grads = [entries[i].view(entries[i].param.grad) for i in bucket_members]
            states = [self.state[entries[i].param] for i in bucket_members]
            hyper = {k: buf.view(()) for k, buf in self._hyper[(bucket.group_index, bucket.device)].items()}
            scale_t, inf_t = scalers[bucket.device]
            momentum_args = dict(
                momentum=hyper["momentum"],
                nesterov=group_cfg.nesterov,
                weight_decay=hyper["weight_decay"],
                weight_decay_method=group_cfg.weight_decay_method,
                grad_scale=self._momentum_grad_divisor(hyper, scale_t),
                found_inf=inf_t,
            )
            l2_params = params if group_cfg.weight_decay_method == "l2" else ()
            outs = [ns_inputs[i] for i in bucket_members]
            if self.state_dtype == "fp32":
                bufs = [entries[i].view(s["momentum_buffer"]) for i, s in zip(bucket_members, states)]
                ops.foreach_momentum_(grads, bufs, outs, l2_params, **momentum_args)
            else:  # codes shaped like the local param; the other lists pair up element by element
                codes = [local(s["momentum_buffer"]) for s in states]
                scales = [local(s["momentum_buffer_scales"]) for s in states if "momentum_buffer_scales" in s]
                ops.foreach_momentum_quantized_(grads, codes, scales, outs, l2_params, block_size=self.state_block_size,
                                                seed=self._state_seeds[bucket.device], **momentum_args)
            launches.append((bucket, group, group_cfg, bucket_members, params, grads, states, hyper, scale_t, inf_t))
        return launches

    def _orthogonalize_phase(self, plan: Plan, members: list[int], ns_inputs: dict,
                             stacked: dict) -> tuple[dict, dict]:
        """2. Newton–Schulz per stack (sharded matrices: owner or gather mode, see _sharded), then a
        subclass's orthogonalize() override. Returns the raw updates and their scales."""
        entries = plan.entries
        updates: dict[int, torch.Tensor] = {}
        by_config: dict[int, list[int]] = {}  # sharded matrices: groups with their own settings run apart
        for i in members:
            if entries[i].stack_index < 0:
                by_config.setdefault(id(plan.configs[entries[i].group_index]), []).append(i)
        for sharded in by_config.values():
            outs = self._sharded.run([entries[i].sharding for i in sharded], [ns_inputs[i] for i in sharded],
                                     plan.configs[entries[sharded[0]].group_index])
            updates.update(zip(sharded, outs))
        for si, (stack_members, x) in stacked.items():
            results = self._orthogonalize(plan.stacks[si], x)
            slices = results.unbind(0) if isinstance(results, torch.Tensor) else results
            k = 0
            for i in stack_members:
                e = entries[i]
                if len(e.local_shape) == 2:
                    updates[i] = slices[k]
                else:  # the E results of a batch entry: contiguous slices of one output
                    updates[i] = torch.stack(results[k : k + e.batch]) if isinstance(results, list) \
                        else results[k : k + e.batch]
                k += e.batch
        scales = {i: entries[i].update_scale for i in members}
        if type(self).orthogonalize is not OrthogonalizedOptimizer.orthogonalize:
            self._call_orthogonalize_override(entries, members, ns_inputs, updates, scales)
        return updates, scales

    def _update_phase(self, plan: Plan, launches: list[tuple], updates: dict, scales: dict, ns_inputs: dict) -> None:
        """3. Second-moment normalization (AdaptiveMuon), 4. decay + update, per bucket."""
        hook = self._weight_update_hook
        for bucket, group, group_cfg, members, params, grads, states, hyper, scale_t, inf_t in launches:
            bucket_updates = [updates[i] for i in members]
            bucket_scales = [scales[i] for i in members]
            if self._config.moment2_method is not None:
                self._normalize(group, members, bucket_updates, grads, states, [ns_inputs[i] for i in members],
                                hyper, scale_t, inf_t)
            # cautious decay too: its mask reads the unscaled update and p before the decay, in the op
            if hook is None:
                ops.foreach_update_(params, bucket_updates, bucket_scales, lr=hyper["lr"],
                                    weight_decay=hyper["weight_decay"],
                                    weight_decay_method=group_cfg.weight_decay_method, found_inf=inf_t)
            else:
                self._hooked_update(hook, params, bucket_updates, bucket_scales, hyper, inf_t,
                                    group_cfg.weight_decay_method)

    def _hooked_update(self, hook, params, updates, scales, hyper, found_inf, weight_decay_method) -> None:
        """Decay, weight-update hook around ``p -= lr·update``, batched over one bucket (EO main's order:
        the hook sees the decayed weight and the scaled update)."""
        if weight_decay_method != "l2":  # decay alone: the update scaled by 0 leaves p as decay made it
            ops.foreach_update_(params, updates, [0.0] * len(params), lr=hyper["lr"],
                                weight_decay=hyper["weight_decay"], weight_decay_method=weight_decay_method,
                                found_inf=found_inf)
        torch._foreach_mul_(updates, scales)
        state = hook.fused_pre(params, updates)
        ops.foreach_update_(params, updates, [1.0] * len(params), lr=hyper["lr"], weight_decay=0.0,
                            weight_decay_method="decoupled", found_inf=found_inf)
        hook.fused_post(params, state)

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
        if entry.stack_index < 0:
            # A matrix spanning ranks: a collective, so every rank of its mesh must call this.
            out = self._sharded.run([entry.sharding], [x.contiguous()], plan.configs[entry.group_index])[0]
        else:
            res = self._orthogonalize(plan.stacks[entry.stack_index], x if x.ndim == 3 else x.unsqueeze(0))
            out = res[0] if x.ndim == 2 else (res if isinstance(res, torch.Tensor) else torch.stack(res))
        return out if self._config.moment2_method is not None else out * entry.update_scale

    def _call_orthogonalize_override(self, entries, members, ns_inputs, updates, scales) -> None:
        """Runs a subclass's orthogonalize() for every member (its results replace the batched ones)."""
        muon = self._config.moment2_method is None
        batched = {}
        for i in members:
            e = entries[i]
            # Muon's orthogonalize returns the scaled update; QKV parts are scaled already.
            result = updates[i] * e.update_scale if muon and e.update_scale != 1.0 else updates[i]
            batched[id(e.param)] = (ns_inputs[i], result)
        self._batched = batched
        try:
            for i in members:
                e = entries[i]
                group = self.param_groups[e.group_index]
                out = self.orthogonalize(e.param, ns_inputs[i], **{k: v for k, v in group.items() if k != "params"})
                if not isinstance(out, torch.Tensor) or tuple(out.shape) != e.local_shape:
                    raise ValueError(
                        f"{type(self).__name__}.orthogonalize must return a tensor of shape {e.local_shape} for a "
                        f"param of shape {tuple(e.param.shape)}, got "
                        f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}"
                    )
                updates[i] = out.to(torch.float32).contiguous()
                if muon:
                    scales[i] = 1.0  # already scaled
        finally:
            self._batched = None

    def _orthogonalize(self, stack: Stack, x: torch.Tensor) -> list[torch.Tensor]:
        """Newton–Schulz of one stack: (k, m, n) fp32 NS inputs -> k fp32 (m, n) updates.

        Plain matrices come back raw (scaled later, in foreach_update_). QKV parts come back scaled
        for Muon (the split op fuses it) and raw for AdaptiveMuon (scaled after normalization).
        """
        cfg = stack.config
        scale_parts = cfg.moment2_method is None
        tp = stack.tp
        if tp is not None and tp.mode == "distributed":
            out = distributed_orthogonalize(x, tp, stack.qkv, stack.global_shape, cfg, scaled=scale_parts)
            return list(out.unbind(0))
        if tp is not None:  # duplicated: orthogonalize the global matrices on every rank
            x = gather_shards(x, tp)
        if stack.qkv is None:
            if tp is None:
                return cfg.newton_schulz(x)  # indexed like a list of its k matrices
            outs = list(cfg.newton_schulz(x).unbind(0))
        else:  # every part of every projection of the stack: one batched NS per part size
            outs = list(
                cfg.newton_schulz_split(x, stack.qkv.sizes, x.shape[-2] // stack.qkv.total, scaled=scale_parts).unbind(0)
            )
        return outs if tp is None else [local_chunk(o, tp) for o in outs]

    def _normalize(self, group, members, updates, grads, states, ns_inputs, hyper, grad_scale, found_inf) -> None:
        """Second-moment normalization of the raw NS output of one bucket, then per-part QKV scales."""
        cfg = self._config
        entries = self._plan.entries
        beta2, eps = hyper["beta2"], hyper["eps"]
        method = cfg.moment2_method
        if method == "adamuon" and self.state_dtype != "fp32":  # elementwise: whole local tensors
            lms.adamuon_normalize_quantized_(
                updates, [local(s["moment2_buffer"]) for s in states],
                [local(s["moment2_buffer_scales"]) for s in states if "moment2_buffer_scales" in s],
                beta2=beta2, eps=eps, block_size=self.state_block_size, seed=self._state_seeds[updates[0].device],
                found_inf=found_inf)
            for j, i in enumerate(members):
                if entries[i].qkv is not None:
                    _scale_parts_(updates[j], entries[i].qkv, entries[i].part_scales)
            return
        moment2 = []
        for j, i in enumerate(members):
            v = local(states[j]["moment2_buffer"])
            moment2.append(entries[i].view(v) if method == "adamuon" else v)
        # Statistics over a whole matrix: TP shards and sharded DTensors reduce them across ranks;
        # everything else goes to the fused op, nd_mode "batch" entries as their 2-D slices.
        subsets: dict[Any, list[int]] = {}
        fused: list[tuple] = []
        spanning: list[int] = []
        for j, i in enumerate(members):
            e = entries[i]
            if method != "adamuon" and e.tp is not None:
                subsets.setdefault(e.tp.key, []).append(j)
            elif method != "adamuon" and e.sharding is not None and e.sharding.kind != "local":
                spanning.append(j)
            elif len(e.local_shape) == 2:
                fused.append((updates[j], moment2[j], grads[j], ns_inputs[j]))
            else:
                x = ns_inputs[j]
                for k in range(e.batch):
                    fused.append((updates[j][k], moment2[j][k], grads[j][k], None if x is None else x[k]))
        if fused:
            u, v, g, x = (list(t) for t in zip(*fused))
            if method == "adamuon":
                ops.adamuon_normalize_(u, v, beta2=beta2, eps=eps, found_inf=found_inf)
            elif method == "normuon":
                ops.normuon_normalize_(u, v, beta2=beta2, eps=eps, found_inf=found_inf)
            else:
                ops.namo_normalize_(u, v, g, x, beta2=beta2, eps=eps, grad_scale=grad_scale, found_inf=found_inf)
        if spanning:
            as3 = lambda t: t if t.ndim == 3 else t.unsqueeze(0)  # noqa: E731
            lays = [entries[members[j]].sharding for j in spanning]
            u = [as3(updates[j]) for j in spanning]
            if method == "normuon":
                sharded_normuon_(u, [as3(moment2[j]) for j in spanning], lays,
                                 [entries[members[j]].normuon_dim for j in spanning], beta2=beta2, eps=eps,
                                 found_inf=found_inf)
            else:
                sharded_namo_(u, [moment2[j].view(-1) for j in spanning], [as3(grads[j]) for j in spanning],
                              [as3(ns_inputs[j]) for j in spanning], lays, beta2=beta2, eps=eps,
                              grad_scale=grad_scale, found_inf=found_inf)
        for key, js in subsets.items():
            u = [updates[j] for j in js]
            v = [moment2[j] for j in js]
            sub_entries = [entries[members[j]] for j in js]
            if method == "normuon":
                tp_normuon_normalize_(u, v, sub_entries, beta2=beta2, eps=eps, found_inf=found_inf)
            else:
                tp_namo_normalize_(
                    u, v, [grads[j] for j in js], [ns_inputs[j] for j in js], sub_entries, beta2=beta2, eps=eps,
                    grad_scale=grad_scale, found_inf=found_inf,
                )
        for j, i in enumerate(members):
            entry = entries[i]
            if entry.qkv is not None:
                _scale_parts_(updates[j], entry.qkv, entry.part_scales)


# The fused step reproduces these methods; a subclass replacing one gets the per-parameter step.
OrthogonalizedOptimizer._fused_hook_defaults = {name: getattr(OrthogonalizedOptimizer, name) for name in BASE_HOOK_NAMES}


# The weight-decay methods of EO's per-parameter step (``_apply_weight_decay_inplace``).
EO_WEIGHT_DECAY_METHODS = ("decoupled", "independent", "l2", "palm")


def _nonzero(value) -> bool:
    """``value != 0`` for a group's weight decay, as EO tests it (a tensor is read, as EO reads it)."""
    return bool(value != 0.0)


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


def _capturing_cuda_graph(plan: Plan) -> bool:
    return any(b.device.type == "cuda" for b in plan.buckets) and torch.cuda.is_current_stream_capturing()


def _host_value(value) -> float | None:
    """The value of a per-step hyper-parameter held on the host (a Python number or a CPU tensor,
    read without touching any device), or None for a tensor on a device."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" else None
    return float(value)


def _write_scalar(buf: torch.Tensor, value) -> None:
    # ``buf`` has one element (see _rebuild_plan). Compiled writes go through a 1-element view:
    # torch 2.13's inductor drops in-place writes to a 0-dim float64 tensor (the step would run
    # with lr = 0).
    host_tensor = isinstance(value, torch.Tensor) and value.device.type == "cpu" and buf.device.type != "cpu"
    if isinstance(value, torch.Tensor) and (not host_tensor or torch.compiler.is_compiling()):
        buf.view(1).copy_(value.reshape(1))  # a device tensor keeps the step capturable in a CUDA graph
    elif torch.compiler.is_compiling():
        buf.view(1).zero_().add_(value)  # keeps the float a graph input (fill_ would specialize on it)
    else:
        # A Python number, or a CPU tensor for a device buffer: read on the host and written by a
        # fill kernel (a copy_ from pageable host memory would synchronize with the device).
        buf.fill_(_host_value(value))


# Each stack's NS input starts this many floats (256 bytes) into the flat buffer after the previous
# one, as a tensor of its own would be aligned: vectorized kernels and cuBLASLt see the same
# alignment as without the shared buffer.
_STACK_ALIGN_FLOATS = 64


def _aligned(floats: int) -> int:
    return -(-floats // _STACK_ALIGN_FLOATS) * _STACK_ALIGN_FLOATS


def _scale_parts_(update: torch.Tensor, qkv: QKVSplit, part_scales) -> None:
    """Multiplies each QKV part of a (rows, cols) update by its own Muon scale, in place."""
    view = update.view(update.shape[0] // qkv.total, qkv.total, update.shape[1])
    for offset, size, scale in part_scales:
        view[:, offset : offset + size, :].mul_(scale)
