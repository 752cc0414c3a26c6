"""Motif's parallel Muon (Motif-Technologies/optimizer) on :class:`megatron_eopt.optim.HybridMuon`
(served by ``megatron_eopt.muon``).

Motif's numbers, reproduced by the fused optimizers:

- Muon groups: SGD-style momentum ``buf = momentum·buf + g`` (Nesterov input
  ``g + momentum·buf``), stored as ``momentum_buffer`` exactly as Motif stores it; Newton–Schulz
  with Motif's five-row quintic table (``coefficient_type="quintic"``: (4.0848, −6.8946, 2.9270)
  ... (2.8366, −3.0525, 1.2012)) in bf16, all five rows whatever ``ns_steps`` says (Motif's
  iteration runs its table); ``p *= 1 - lr·wd`` then ``p -= lr·0.2·√max(m, n)·update``, with
  ``(m, n)`` the last two dims (an expert tensor ``(E, m, n)`` is E matrices, each normalized and
  orthogonalized on its own).
- AdamW groups: torch's fused AdamW with the group's ``lr``, ``adamw_betas``, ``adamw_eps`` and
  ``weight_decay``; state ``step`` (fp32 0-dim tensor), ``moment1``, ``moment2``.
- Param groups carry Motif's keys (``lr``, ``weight_decay``, ``momentum``, ``nesterov``,
  ``ns_steps``, ``adamw_betas``, ``adamw_eps``, ``none_grad``, ``use_muon``, ``names``), so a
  ``state_dict()`` of either optimizer loads into the other.
- QK-clip with Motif's semantics (:mod:`.motif_qk_clip`).

The SGD buffer runs through the fused EMA momentum op: dividing the gradient by ``1 - momentum``
turns ``buf ← buf + (1 - momentum)·(g' - buf)`` into ``buf ← momentum·buf + g`` and its Nesterov
input ``(1 - momentum)·g' + momentum·buf`` into ``g + momentum·buf``.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping

import torch
from torch.optim.adam import adam as adam_functional

from ..optim.multirank.dtensor_layout import is_dtensor, placement_kind
from ..optim.hybrid import HybridMuon
from ..optim.muon import Muon as FusedMuon
from ._deprecation import _warn_once
from .motif_qk_clip import MotifClipConfig, apply_motif_clip, find_targets, parse_qk_layer, plan_motif_clip

__all__ = ["MotifMuon", "default_is_muon", "get_default_muon_param_groups", "parse_qk_layer"]

MOTIF_KEYS = ("adamw_betas", "adamw_eps", "none_grad", "debug", "clip_config", "warmup_step", "chunk_size",
              "use_distributed_muon", "expert_keys", "cpu_offload")
# The defaults that lr=None / weight_decay=None stand for (megatron_eopt.muon.Muon shows None for both).
MOTIF_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.1}
# Names Motif's default routing keeps away from Muon (substrings of the parameter name).
_SKIP_KEYS = ("embeddings", "lm_head", "model.norm")


def is_motif_call(params: list, kwargs: Mapping[str, Any]) -> bool:
    return any(k in kwargs for k in MOTIF_KEYS) or any(isinstance(g, Mapping) and "use_muon" in g for g in params)


def default_is_muon(name: str, x: torch.Tensor) -> bool:
    """Motif's default routing: every tensor of two or more dims goes to Muon unless its name
    contains ``embeddings``, ``lm_head`` or ``model.norm`` (so ``model.embed_tokens.weight`` and
    ``output.weight`` are Muon parameters, as in Motif)."""
    return x.ndim >= 2 and not any(key in name for key in _SKIP_KEYS)


def get_default_muon_param_groups(model: torch.nn.Module,
                                  is_muon_func: Callable[[str, torch.Tensor], bool] = default_is_muon):
    """Motif's two groups: ``{"params", "names", "use_muon": True}`` for the parameters
    ``is_muon_func(name, param)`` accepts, ``{"params", "use_muon": False}`` for the rest (frozen
    parameters left out); both groups are returned even when one is empty."""
    _warn_once("get_default_muon_param_groups")
    muon_params, muon_names, others = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_muon_func(name, p):
            muon_params.append(p)
            muon_names.append(name)
        else:
            others.append(p)
    return [{"params": muon_params, "names": muon_names, "use_muon": True},
            {"params": others, "use_muon": False}]


class _SGDBufferMuon(FusedMuon):
    """The fused Muon with Motif's momentum buffer ``buf = momentum·buf + g`` (see the module
    docstring): the gradient reaches the EMA op divided by ``1 - momentum``."""

    def _momentum_grad_divisor(self, hyper, grad_scale):
        divisor = 1.0 - hyper["momentum"]
        return divisor if grad_scale is None else divisor * grad_scale


def _check_muon_params(groups: list[dict], expert_keys) -> None:
    """Muon tensors of more than two dims must be experts named by ``expert_keys`` (Motif's
    newest release refuses the others: flattening them would not be Motif's update)."""
    keys = tuple(expert_keys or ())
    for gi, g in enumerate(groups):
        if not g.get("use_muon"):
            continue
        names = g.get("names")
        for pi, p in enumerate(g["params"]):
            if p.ndim <= 2:
                continue
            name = names[pi] if names is not None and pi < len(names) else None
            if name is None or not any(k in name for k in keys):
                label = repr(name) if name is not None else f"param_groups[{gi}]['params'][{pi}] (no 'names')"
                raise ValueError(
                    f"{label} has shape {tuple(p.shape)}: Muon takes a tensor of more than two dims only as a "
                    f"batch of experts whose name contains one of expert_keys={list(keys)} (each (m, n) slice "
                    "orthogonalized on its own); pass expert_keys, or route the tensor to AdamW")


# block scales (state_dtype int8 / fp8), the rounding seed and the format version: checked on load by
# the Muon side (megatron_eopt.optim.step.state_dtype)
_LOW_MEMORY_KEYS = ("momentum_buffer_scales", "moment2_buffer_scales", "state_seed", "state_format")


class MotifMuon(HybridMuon):
    """Motif's ``Muon(params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
    adamw_betas=(0.9, 0.95), adamw_eps=1e-8, none_grad=True, debug=False, clip_config=...,
    warmup_step=5, chunk_size=-1, use_distributed_muon=False, expert_keys=None, cpu_offload=False)``
    with ``step(closure=None, qk_logits=None)``.

    ``params`` are groups each flagged ``use_muon`` (``get_default_muon_param_groups(model)``);
    the keyword arguments are the defaults of every group's Motif keys. ``nesterov`` must agree
    across the Muon groups. ``none_grad`` (per group) drops, after the step, the gradients of the
    Muon parameters sharded across ranks (DTensors not fully replicated), as Motif's pipeline
    does; other gradients stay. ``cpu_offload=True`` keeps the state in host memory between
    steps. ``debug``, ``warmup_step``, ``chunk_size`` and ``use_distributed_muon`` tune Motif's
    own communication pipeline: accepted, with no effect on the numbers (DTensor parameters take
    the fused owner pipeline). ``clip_config=None`` (or without indices) leaves QK-clip off.
    ``state_dtype`` (an extension: "fp32" | "bf16" | "int8" | "fp8") stores the Muon momentum in a
    low-memory format (see :class:`megatron_eopt.optim.Muon`); the AdamW state stays fp32.
    """

    _muon_class = _SGDBufferMuon

    def __init__(self, params, lr: float | None = 1e-3, weight_decay: float | None = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8,
                 none_grad: bool = True, debug: bool = False, clip_config: Mapping[str, Any] | None = None,
                 warmup_step: int = 5, chunk_size: int = -1, use_distributed_muon: bool = False, expert_keys=None,
                 cpu_offload: bool = False, state_dtype: str = "fp32") -> None:
        lr = MOTIF_DEFAULTS["lr"] if lr is None else lr  # None: Motif's default (megatron_eopt.muon.Muon's lr=None)
        weight_decay = MOTIF_DEFAULTS["weight_decay"] if weight_decay is None else weight_decay
        if isinstance(params, types.GeneratorType):
            raise ValueError("params must be a list of param groups, each with a 'use_muon' key (e.g. "
                             "get_default_muon_param_groups(model)), not a generator")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not (chunk_size == -1 or chunk_size > 0):
            raise ValueError(f"chunk_size must be -1 or a positive int, got {chunk_size!r}")
        betas = tuple(adamw_betas)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=bool(nesterov),
                        ns_steps=ns_steps, adamw_betas=betas, adamw_eps=adamw_eps, none_grad=bool(none_grad))
        groups = []
        for i, g in enumerate(params):
            if not isinstance(g, Mapping):
                raise TypeError(f"param_groups[{i}] must be a dict with a 'use_muon' key, got {type(g).__name__}")
            if g.get("use_muon") is None:
                raise ValueError(f"param_groups[{i}] has no 'use_muon' key: say True (Muon) or False (AdamW), e.g. "
                                 "with get_default_muon_param_groups(model)")
            group = {**defaults, **g}
            ps = group.get("params", ())
            group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)  # a generator is read once
            groups.append(group)
        for i, g in enumerate(groups):
            if len(tuple(g["adamw_betas"])) != 2:
                raise ValueError(f"param_groups[{i}]['adamw_betas'] must be a pair, got {g['adamw_betas']!r}")
        nesterovs = {bool(g["nesterov"]) for g in groups if g["use_muon"]}
        if len(nesterovs) > 1:
            raise ValueError("nesterov must be the same in every Muon group (one fused momentum pass)")
        _check_muon_params(groups, expert_keys)
        self.motif_clip_config = MotifClipConfig.from_dict(clip_config)
        self.none_grad = bool(none_grad)
        self.debug, self.warmup_step, self.chunk_size = debug, warmup_step, chunk_size
        self.use_distributed_muon = use_distributed_muon
        self.expert_keys = list(expert_keys) if expert_keys is not None else None
        self._motif_plan = None
        self._motif_defaults = defaults
        super().__init__(
            groups,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            adamw_betas=betas,
            adamw_eps=adamw_eps,
            cpu_offload=cpu_offload,
            state_dtype=state_dtype,
            nesterov=nesterovs.pop() if nesterovs else bool(nesterov),
            weight_decay_method="decoupled",
            fp32_matmul_prec="medium",
            coefficient_type="quintic",
            num_ns_steps=5,  # Motif's iteration runs its five-row table, whatever ns_steps says
            scale_mode="spectral",
            extra_scale_factor=0.2,
            nd_mode="batch",
        )
        self._motif_targets = find_targets(self.param_groups, self.motif_clip_config)

    # ------------------------------------------------------------------ QK-clip (Motif's rule)
    def _check_step_input(self, qk_logits) -> None:
        self._motif_plan = plan_motif_clip(self._motif_targets, qk_logits, self.motif_clip_config)
        self._check_adamw_grads()

    def _apply_qk_clip(self, qk_logits) -> None:
        plan, self._motif_plan = self._motif_plan, None
        if plan is not None:
            apply_motif_clip(plan)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_motif_targets"):  # after construction: Motif's defaults and checks first
            if param_group.get("use_muon") is None:
                raise ValueError("the param group has no 'use_muon' key: say True (Muon) or False (AdamW)")
            group = {**self._motif_defaults, **param_group}
            _check_muon_params([group], self.expert_keys)
            super().add_param_group(group)
            self._motif_targets = find_targets(self.param_groups, self.motif_clip_config)
            return
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this class or of Motif's optimizer (the same layout), after checking
        every state tensor against its parameter: nothing changes when one cannot follow it."""
        groups = state_dict.get("param_groups", [])
        ids = [i for g in groups for i in g.get("params", [])]
        params = [p for g in self.param_groups for p in g["params"]]
        if len(ids) == len(params):  # otherwise torch's own check refuses the group structure
            by_id = dict(zip(ids, params))
            for key, entry in state_dict.get("state", {}).items():
                p = by_id.get(key)
                if p is None:
                    raise ValueError(f"state_dict['state'] has an entry {key!r} that names no parameter")
                for name, value in entry.items():
                    if name in _LOW_MEMORY_KEYS:
                        continue
                    if name == "step":
                        ok = not isinstance(value, torch.Tensor) or value.numel() == 1
                    else:
                        ok = not isinstance(value, torch.Tensor) or tuple(value.shape) == tuple(p.shape)
                    if not ok:
                        raise ValueError(f"state_dict['state'][{key!r}][{name!r}] has shape {tuple(value.shape)}, "
                                         f"its parameter {tuple(p.shape)}: it cannot follow that parameter")
        super().load_state_dict(state_dict)

    # ------------------------------------------------------------------ AdamW with Motif's state keys
    def _adamw_lists(self) -> None:
        return None  # Motif's state is created by _adamw_step itself (traced code under torch.compile)

    def _adamw_step(self, lists: None = None) -> None:
        """torch's AdamW kernel (fused, as Motif runs it) over Motif's state: ``step`` (fp32 0-dim
        on the param's device), ``moment1``, ``moment2``; betas and eps from the group's
        ``adamw_betas`` / ``adamw_eps``."""
        for group in self._adamw.param_groups:
            params, grads, moment1, moment2, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["moment1"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["moment2"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif not isinstance(state["step"], torch.Tensor):  # a step saved as a number
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32, device=p.device)
                params.append(p)
                grads.append(p.grad)
                moment1.append(state["moment1"])
                moment2.append(state["moment2"])
                steps.append(state["step"])
            if not params:
                continue
            beta1, beta2 = group["adamw_betas"]
            # Motif's kernel: torch's fused AdamW (CPU and CUDA; DTensors take their local shards).
            adam_functional(
                params, grads, moment1, moment2, [], steps,
                amsgrad=False, has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["adamw_eps"], maximize=False,
                foreach=None, capturable=False, differentiable=False, fused=True, decoupled_weight_decay=True,
            )

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None, qk_logits=None):
        loss = super().step(closure, qk_logits=qk_logits)
        for group in self.param_groups:
            if not (group["use_muon"] and group["none_grad"]):
                continue
            for p in group["params"]:  # Motif frees the grads its all-to-all pipeline consumed
                if is_dtensor(p) and not all(placement_kind(pl) == "replicate" for pl in p.placements):
                    p.grad = None
        return loss
