"""The state of the fused optimizers in one home: creation (shapes, dtypes, low-memory formats),
the checks before it is created, saving, loading and pickling.

A mixin of :class:`~megatron_eopt.optim.orthogonalized.OrthogonalizedOptimizer`: it reads the
optimizer's configuration (``_config``), plan (``_current_plan``) and state settings
(``state_dtype``, ``state_block_size``), and writes ``self.state``. The formats themselves are
``state_dtype``'s; what a loaded checkpoint must look like is ``state_check``'s.
"""

from __future__ import annotations

from typing import Any

import torch

from ... import low_memory_state as lms
from ...second_moment import moment2_state_shape
from . import state_dtype as _low_memory
from .._config import config_setting_names
from .._eo_hooks import EOExtensionPoints
from .grouping import Plan
from ..multirank.dtensor_layout import zeros_state
from ..multirank.sharded import ShardedOrthogonalizer
from .engine import StepEngine
from .overlap import BackwardOverlap
from .state_check import check_loaded_state


class FusedState:
    """State creation, loading and saving of the fused step (see the module docstring)."""

    # Low-memory state (see megatron_eopt.low_memory_state): set by the fused classes' constructors.
    state_dtype = "fp32"
    state_block_size = lms.DEFAULT_BLOCK_SIZE

    @property
    def _low_memory_state(self) -> bool:
        """True when the state is stored in a low-memory format (``state_dtype`` other than fp32)."""
        return lms.is_low_memory(self.state_dtype)

    # Pickling, copying and loading rebuild the plan: they run outside dynamo (as torch.optim's own
    # state_dict, load_state_dict and add_param_group do), so an optimizer copied or loaded inside
    # a compiled function is complete.
    def _wait_for_overlap(self) -> None:
        """Waits for the work backward started (``overlap_backward``): it writes the momentum of the
        chunks it started."""
        overlap = self.__dict__.get("_overlap")
        if overlap is not None:
            overlap.wait()

    @torch._disable_dynamo
    def __getstate__(self) -> dict[str, Any]:
        # torch.optim.Optimizer pickles defaults, state and param_groups only; the settings kept on
        # the instance go along (copy.deepcopy, pickle), the plan is rebuilt on the other side.
        self._wait_for_overlap()
        state = super().__getstate__()
        transient = ("_plan", "_hyper", "_batched", "_sharded", "_state_seeds", "_engine", "_overlap",
                     "_ride_ticket", "_ride_copies")  # (a ticket holds a process group: a copy agrees afresh)
        state.update({k: v for k, v in self.__dict__.items() if k not in state and k not in transient})
        return state

    @torch._disable_dynamo
    def __setstate__(self, state: dict[str, Any]) -> None:
        for name in config_setting_names(type(self)):  # pickled while these were plain attributes
            if name in state:
                value = state.pop(name)
                if state.get("_config") is None:
                    state["_" + name] = value
        super().__setstate__(state)
        self._batched = None
        if self._config is None:
            return
        self._sharded = ShardedOrthogonalizer(self._config)
        if "_engine" not in self.__dict__:  # a copy's own (load_state_dict, which calls this too, keeps it)
            self._engine = StepEngine(self)
        if getattr(self, "overlap_backward", False) and "_overlap" not in self.__dict__:
            # a copy (pickle, deepcopy): hooks on its own params, made with its plan; load_state_dict
            # (which calls this too) keeps the optimizer's own
            self._overlap = BackwardOverlap(self._engine)
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
            # A copy (pickle, deepcopy) is made by one rank alone as often as by all: its plan is the
            # original's, agreed when that was built, so the copy does not ask the other ranks.
            self._agree_ranks = False
            try:
                self._rebuild_plan()
            finally:
                del self._agree_ranks

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Low-memory entries are converted to this optimizer's state_dtype first (they bypass torch's
        # cast to the parameter's dtype); every misfit is refused before anything changes.
        held = {}
        if self._config is not None:
            state_dict, held = _low_memory.split_state_dict(self, state_dict, self._low_memory_target)
            state_dict = self._reshape_flattened_moment2(state_dict)
        check_loaded_state(self, state_dict)
        super().load_state_dict(state_dict)
        _low_memory.restore(self, state_dict, held, self._state_seeds if self._config is not None else None)

    def _reshape_flattened_moment2(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Checkpoints saved before the NorMuon / NAMO state of an ``nd_mode="batch"`` parameter of
        more than three dims kept its leading dims ((A * B, m, 1), now (A, B, m, 1)) load as views of
        the new layout; everything else is left to the check."""
        saved_groups = state_dict.get("param_groups")
        if self._config.moment2_method in (None, "adamuon") or not isinstance(saved_groups, (list, tuple)):
            return state_dict
        params = {}
        for saved, group in zip(saved_groups, self.param_groups):
            params.update({index: p for index, p in zip(saved.get("params", ()), group["params"]) if p.dim() > 3})
        state = dict(state_dict.get("state", {}))
        changed = False
        for index, p in params.items():
            v = state.get(index, {}).get("moment2_buffer") if isinstance(state.get(index), dict) else None
            want = self._expected_state(p, "moment2_buffer")
            if not isinstance(v, torch.Tensor) or want is None or tuple(v.shape) == want[0]:
                continue
            lead = len(p.shape) - 2
            if v.dim() == len(want[0]) - lead + 1 and v.numel() == torch.Size(want[0]).numel() \
                    and tuple(v.shape[1:]) == want[0][lead:]:
                state[index] = {**state[index], "moment2_buffer": v.reshape(want[0])}
                changed = True
        return {**state_dict, "state": state} if changed else state_dict

    def state_dict(self) -> dict[str, Any]:
        # Low-memory state also saves the stochastic rounding's seed and its format version (see
        # state_dtype): a resumed run draws what the uninterrupted one would have.
        state_dict = super().state_dict()
        if self._config is not None and self._low_memory_state:
            state_dict = _low_memory.add_resume_entries(state_dict, self.param_groups, self._state_seeds)
        return state_dict

    def _low_memory_target(self, p: torch.Tensor):
        """(state_dtype, block size, keys that follow it) for a parameter of this optimizer."""
        keys = (_low_memory.MOMENTUM,) + ((_low_memory.MOMENT2,) if self._config.moment2_method == "adamuon" else ())
        return self.state_dtype, self.state_block_size, keys, self._global_view(p)

    def _global_view(self, p: torch.Tensor) -> tuple[int, ...]:
        """The matrix view of the whole parameter p (its shape where it has no plan entry)."""
        plan = self._current_plan()
        entry = plan.entries[plan.index[id(p)]] if id(p) in plan.index else None
        if entry is None:
            return tuple(p.shape)
        return entry.local_shape if entry.sharding is None else entry.sharding.view_shape

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
        return moment2_state_shape(method, tuple(p.shape), entry.local_shape, entry.normuon_dim), torch.float32

    # ------------------------------------------------------------------ creation
    def _init_entry_state(self, index: int) -> dict:
        """Creates what is missing of entry ``index``'s state; returns its state dict."""
        entry = self._plan.entries[index]
        p = entry.param
        state = self.state[p]
        method = self._config.moment2_method
        view = entry.local_shape if entry.sharding is None else entry.sharding.view_shape  # the whole matrix view
        if "momentum_buffer" not in state:
            if self._low_memory_state:
                state.update(_low_memory.new_state(p, "momentum_buffer", self.state_dtype, self.state_block_size,
                                                   view))
            else:
                # A DTensor param gets a DTensor state with its mesh and placements (DCP reshards it).
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if method == "adamuon" and self._low_memory_state and "moment2_buffer" not in state:
            state.update(_low_memory.new_state(p, "moment2_buffer", self.state_dtype, self.state_block_size, view))
        if method is not None and "moment2_buffer" not in state:
            # fp32 whatever p's dtype (the normalization ops keep their statistics in fp32; for
            # fp32 params this is Emerging-Optimizers' layout, which stores p's dtype).
            # nd_mode "batch": one statistic per matrix, (E, m, 1) / (E, 1, n) / (E, 1), the
            # parameter's own leading dims kept (moment2_state_shape).
            shape = moment2_state_shape(method, tuple(p.shape), view, entry.normuon_dim)
            if entry.sharding is None:
                state["moment2_buffer"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
            elif method == "adamuon":  # elementwise: sharded exactly like p
                state["moment2_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            else:
                nd = len(view)
                kept = set(range(nd - 2))  # one statistic per matrix of a batch
                if method == "normuon":  # and one per row (column) of the side not averaged over
                    kept.add(nd - 1 if entry.normuon_dim == -2 else nd - 2)
                state["moment2_buffer"] = zeros_state(p, entry.sharding, shape, torch.float32, kept)
        return state

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
