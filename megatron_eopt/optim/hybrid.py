"""HybridMuon: one optimizer for a whole model, Muon for the groups flagged ``use_muon=True`` and
AdamW for the rest (Motif's parallel Muon, Moonlight / Kimi K2's MuonClip, Keller Jordan's
``MuonWithAuxAdam``), with QK-clip and CPU offload of the optimizer state.

The Muon groups run through the fused :class:`Muon` / :class:`AdaptiveMuon` path (every option of
those classes, ``nd_mode`` and DTensor params included); the AdamW groups through torch's own
AdamW (its fused kernel on CUDA, foreach otherwise) with per-group ``lr``, ``betas``, ``eps`` and
``weight_decay``. Both inner optimizers hold the very group dicts of ``param_groups`` and share one
``state``, so schedulers, ``state_dict()`` and ``load_state_dict()`` see a single optimizer.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
from torch.optim.adam import adam as adam_functional

from ..step_stats import StepStatsReporter, records_step_stats
from ._closure import closure_loss
from .step.offload import StateOffload
from .step.state_check import check_loaded_state, like_param
from .step import state_dtype as _low_memory
from .adaptive_muon import AdaptiveMuon
from .muon import Muon
from .multirank.dtensor_layout import is_dtensor
from .qk_clip import ClipConfig, ClipTarget, parse_target, plan_clip, scale_row_blocks_

# Keys that belong to the AdamW side of a group; the Muon side ignores them.
ADAMW_KEYS = ("betas", "eps", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


class HybridMuon(StepStatsReporter, torch.optim.Optimizer):
    """Muon for ``use_muon=True`` groups, AdamW for ``use_muon=False`` groups, in one optimizer.

    Arguments: ``params`` as param-group dicts, each with a ``use_muon`` flag and optionally
    ``names`` (the parameters' names, needed for QK-clip and for ``expert_keys``); ``lr``,
    ``momentum``, ``weight_decay`` and every :class:`Muon` keyword (``nesterov``,
    ``fp32_matmul_prec``, ``coefficient_type``, ``num_ns_steps``, ``scale_mode``,
    ``extra_scale_factor``, ``weight_decay_method``, ``nd_mode``, ``state_dtype`` (the Muon side's state;
    AdamW keeps fp32), ``workspace_mib`` (the Muon side's step budget, also an attribute), ...; with ``moment2_method`` the
    Muon side is :class:`AdaptiveMuon`, with ``beta2`` and ``eps``) are the Muon groups' defaults;
    ``adamw_lr`` (default: ``lr``), ``adamw_betas``, ``adamw_eps`` and ``adamw_weight_decay`` the
    AdamW groups' defaults. ``clip_config`` (Motif's dict: ``threshold``, ``head_dim``,
    optionally ``q_indices`` / ``k_indices``) turns on QK-clip: ``step(qk_logits={layer: (heads,)
    max logits})``. ``cpu_offload=True`` keeps the state in (pinned) host memory between steps
    (see ``step.offload``: ``opt.state`` waits for the step's copies to the host before it is read).
    Every check of a step's input (gradients of both sides, ``qk_logits``) runs before any
    parameter or state changes.
    """

    # The Muon side without a second moment (a subclass may change its momentum semantics).
    _muon_class = Muon

    def __init__(
        self,
        params: Iterable[Mapping[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        moment2_method: str | None = None,
        clip_config: Mapping[str, Any] | None = None,
        cpu_offload: bool = False,
        **muon_kwargs: Any,
    ) -> None:
        groups = self._check_groups(params)
        self.clip_config = ClipConfig.from_dict(clip_config) if clip_config is not None else None
        muon_groups = [g for g in groups if g["use_muon"]]
        adamw_groups = [g for g in groups if not g["use_muon"]]
        # The inner optimizers fill their defaults into the shared group dicts.
        muon_cls = AdaptiveMuon if moment2_method is not None else self._muon_class
        if moment2_method is not None:
            muon_kwargs["moment2_method"] = moment2_method
        self._muon = muon_cls(muon_groups, lr, momentum, weight_decay, **muon_kwargs) if muon_groups else None
        if self._muon is not None:  # the routing is checked here: every use_muon param must be a matrix
            error = self._muon._step_time_error(at_construction=True)
            if error is not None:
                raise error
        self._adamw = None
        if adamw_groups:
            on_cuda = all(p.is_cuda for g in adamw_groups for p in g["params"])
            self._adamw = torch.optim.AdamW(
                adamw_groups,
                lr=lr if adamw_lr is None else adamw_lr,
                betas=adamw_betas,
                eps=adamw_eps,
                weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
                foreach=None if on_cuda else True,
                fused=True if on_cuda else None,
            )
        super().__init__(groups, {})
        self._link()
        self._clip_targets = self._find_clip_targets() if self.clip_config is not None else []
        self._offload = StateOffload(self)
        if cpu_offload:
            self.turn_on_cpu_offload()

    # ------------------------------------------------------------------ groups
    @staticmethod
    def _check_groups(params) -> list[dict[str, Any]]:
        groups = list(params)
        if not groups or not all(isinstance(g, Mapping) for g in groups):
            raise TypeError("HybridMuon takes a list of param-group dicts, each with a 'use_muon' flag")
        out = []
        for i, g in enumerate(groups):
            if "use_muon" not in g:
                raise ValueError(f"param_groups[{i}] has no 'use_muon' key: say True (Muon) or False (AdamW)")
            if not isinstance(g["use_muon"], bool):
                raise ValueError(f"param_groups[{i}]['use_muon'] must be True or False, got {g['use_muon']!r}")
            group = dict(g)
            group["params"] = list(group["params"])
            if "names" in group:
                names = list(group["names"])
                if len(names) != len(group["params"]):
                    raise ValueError(f"param_groups[{i}]['names'] has {len(names)} names for "
                                     f"{len(group['params'])} params")
                group["names"] = names
            out.append(group)
        return out

    def _link(self) -> None:
        """Points the inner optimizers at this optimizer's group dicts and state."""
        if self._muon is not None:
            self._muon.param_groups = [g for g in self.param_groups if g["use_muon"]]
            self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adamw.state = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "_offload"):  # during construction: the inner optimizers filled the defaults
            super().add_param_group(param_group)
            return
        group = self._check_groups([param_group])[0]
        inner = self._muon if group["use_muon"] else self._adamw
        if inner is None:
            raise ValueError(f"HybridMuon was built without {'Muon' if group['use_muon'] else 'AdamW'} groups, so "
                             "it has no side for this group: pass one such group at construction")
        super().add_param_group(group)  # checks the params against every group of both sides
        try:
            inner.add_param_group(group)  # fills its defaults into the dict both hold
        except Exception:
            self.param_groups.pop()
            raise
        finally:
            self._link()
        if self.clip_config is not None:
            self._clip_targets = self._find_clip_targets()

    def _find_clip_targets(self) -> list[ClipTarget]:
        targets = []
        for gi, group in enumerate(self.param_groups):
            names = group.get("names")
            if names is None:
                continue
            for p, name in zip(group["params"], names):
                t = parse_target(p, name)
                if t is not None:
                    targets.append(t)
        if not targets:
            raise ValueError("clip_config is set but no parameter name marks a query / key / fused QKV weight of a "
                             "layer (give each group 'names', e.g. 'layers.0.attn.q_proj.weight')")
        return targets

    # ------------------------------------------------------------------ state
    @property
    def state(self):
        """The per-parameter state. With CPU offload on, the host copies of a step may still be in
        flight when ``step()`` returns; reaching the state here waits for them first (a no-op when
        none are pending), so host reads after a step see complete values."""
        offload = getattr(self, "_offload", None)
        if offload is not None and offload.pending:
            offload.wait()
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state = value

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "state" in state:  # torch's __setstate__ writes __dict__ directly: through the setter instead
            self.state = state.pop("state")
        super().__setstate__(state)

    def turn_on_cpu_offload(self) -> None:
        """Keeps the optimizer state in (pinned) host memory between steps."""
        self._offload.turn_on()

    def turn_off_cpu_offload(self) -> None:
        """Brings the state back to the parameters' devices and keeps it there."""
        self._offload.turn_off()

    @property
    def cpu_offload(self) -> bool:
        return self._offload.enabled

    @property
    def ns_inputs_below_eps(self) -> torch.Tensor | None:
        """The Muon part's count of Newton–Schulz inputs below the normalization eps in the last step
        (see ``OrthogonalizedOptimizer.ns_inputs_below_eps``); None without Muon groups or before a step."""
        return None if self._muon is None else self._muon.ns_inputs_below_eps

    @property
    def workspace_mib(self) -> float | str | None:
        """The Muon side's step workspace budget (see :class:`Muon`); None without Muon groups."""
        return None if self._muon is None else self._muon.workspace_mib

    @workspace_mib.setter
    def workspace_mib(self, value: float | str | None) -> None:
        if self._muon is not None:
            self._muon.workspace_mib = value

    def state_dict(self) -> dict[str, Any]:
        self._offload.refuse("state_dict()")
        state_dict = super().state_dict()
        muon = self._muon
        if muon is not None and muon._config is not None and muon._low_memory_state:
            mine = {id(q) for g in muon.param_groups for q in g["params"]}
            state_dict = _low_memory.add_resume_entries(state_dict, self.param_groups, muon._state_seeds,
                                                        lambda p: id(p) in mine)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offload.refuse("load_state_dict()")
        held = {}
        muon = self._muon
        if muon is not None and muon._config is not None:  # the Muon side's state_dtype (see step.state_dtype)
            mine = {id(q) for g in muon.param_groups for q in g["params"]}
            state_dict, held = _low_memory.split_state_dict(
                self, state_dict, lambda p: muon._low_memory_target(p) if id(p) in mine else None)
        check_loaded_state(self, state_dict)  # a misfit is refused before anything changes
        super().load_state_dict(state_dict)
        self._link()  # torch built new group dicts and a new state
        _low_memory.restore(self, state_dict, held,
                            muon._state_seeds if muon is not None and muon._config is not None else None)

    def _expected_state(self, p: torch.Tensor, key: str):
        """What ``load_state_dict`` accepts for ``state[p][key]`` (the side that owns p decides)."""
        if self._muon is not None and any(p is q for g in self._muon.param_groups for q in g["params"]):
            return self._muon._expected_state(p, key)
        return like_param(p, key)

    def init_state(self) -> None:
        """Creates the Muon side's state up front (for checkpoint loading); AdamW's is lazy."""
        if self._muon is not None:
            self._muon.init_state()

    # ------------------------------------------------------------------ step
    def _adamw_lists(self) -> list[tuple] | None:
        """torch's AdamW state init over the AdamW groups (``_init_group`` creates the state of a
        param stepped for the first time) and, per group, the lists its functional kernel takes."""
        adamw = self._adamw
        lists = []
        for group in adamw.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = adamw._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
            if params:
                lists.append((group, has_complex, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps))
        return lists

    def _adamw_step(self, lists: list[tuple] | None = None) -> None:
        """torch's AdamW over the AdamW groups: its own state init (``lists``: :meth:`_adamw_lists`,
        made now when None) and functional kernel (fused on CUDA, foreach otherwise), called
        directly so the whole step stays one graph under torch.compile (AdamW.step's grad-mode
        wrapper breaks the graph)."""
        for j, (group, has_complex, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps) in enumerate(
                self._adamw_lists() if lists is None else lists):
            beta1, beta2 = group["betas"]
            lr, capturable = group["lr"], group["capturable"]
            if torch.compiler.is_compiling() and not group["fused"]:
                # compiled foreach: the lr as a tensor, so a schedule writing a new float every step
                # is a graph input (torch's AdamW makes a float lr a constant of the graph); a tensor
                # lr takes torch's capturable formulation
                lr, capturable = self._adamw_lr(j, group["lr"], params[0].device), True
            adam_functional(
                params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2, lr=lr,
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                foreach=group["foreach"], capturable=capturable, differentiable=False, fused=group["fused"],
                decoupled_weight_decay=True,
            )

    def _adamw_lr(self, index: int, value, device: torch.device) -> torch.Tensor:
        """``value``, the lr of the index-th AdamW group stepped, in a 1-element fp64 buffer of its
        own (one dimension: torch.compile gives a 0-dim fp64 CPU tensor input a float symbol, see
        OrthogonalizedOptimizer._rebuild_plan)."""
        buffers = self.__dict__.setdefault("_adamw_lr_buffers", {})
        buf = buffers.get((index, device))
        if buf is None:
            buf = buffers[(index, device)] = torch.zeros(1, dtype=torch.float64, device=device)
        if isinstance(value, torch.Tensor):
            buf.copy_(value.reshape(1))
        else:
            buf.zero_().add_(value)  # keeps the float a graph input (fill_ would specialize on it)
        return buf

    def _check_adamw_grads(self) -> None:
        """The AdamW side's gradients, checked before the Muon side changes anything. Skipped while
        torch.compile traces the step: reading the grads before torch's AdamW ``_init_group`` changes
        what Dynamo captures for them (wrong updates on the second compiled step, torch 2.14)."""
        if self._adamw is None or torch.compiler.is_compiling():
            return
        # The AdamW side's own group list: under torch.compile its group dicts keep one source.
        for gi, group in enumerate(self._adamw.param_groups):
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                where = f"AdamW param group {gi}, params[{pi}]"
                if g.is_sparse:
                    raise ValueError(f"{where}: AdamW does not support sparse gradients")
                if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device or is_dtensor(g) != is_dtensor(p):
                    raise ValueError(f"{where}: grad of a param of shape {tuple(p.shape)}, {p.dtype} on {p.device} "
                                     f"must match it, got shape {tuple(g.shape)}, {g.dtype} on {g.device}")

    def _check_step_input(self, qk_logits) -> None:
        """Everything that can reject a step's input, run before anything changes."""
        if qk_logits is not None and self.clip_config is None:
            raise ValueError("qk_logits given but QK-clip is off: pass clip_config to the constructor")
        # Planned once per step and kept for _apply_qk_clip: planning reads DTensor logits whole
        # (one full_tensor collective each), which the clip after the update must not repeat.
        self._clip_plan = plan_clip(self._clip_targets, qk_logits, self.clip_config) if qk_logits else None
        self._check_adamw_grads()

    def _apply_qk_clip(self, qk_logits) -> None:
        plan, self._clip_plan = getattr(self, "_clip_plan", None), None
        if plan is not None:
            scale_row_blocks_(*plan)

    @torch.no_grad()
    @records_step_stats
    def step(self, closure: Callable[[], float] | None = None, qk_logits: Mapping[int, torch.Tensor] | None = None):
        loss = closure_loss(closure)
        self._check_step_input(qk_logits)
        self._offload.bring_in()
        # Compiled, the AdamW side's state is created before the Muon side's: Dynamo runs torch's
        # AdamW ``_init_group`` for real while it traces, and the Muon side's traced insertions
        # into the shared state dict, written back after the graph, would drop the entries it
        # created (torch 2.14). Eager, it waits for the Muon side's checks.
        adamw_lists = self._adamw_lists() if self._adamw is not None and torch.compiler.is_compiling() else None
        if self._muon is not None:
            self._muon.step()
        if self._adamw is not None:
            self._adamw_step(adamw_lists)
        self._offload.send_out()
        self._apply_qk_clip(qk_logits)
        return loss
