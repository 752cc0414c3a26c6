"""Muon-aware gradient clipping inside Megatron-LM's chained and layer-wise optimizers.

megatron-core's ``ChainedOptimizer.step`` (which its ``LayerWiseDistributedOptimizer`` inherits)
computes one norm over every sub-optimizer's gradients and clips each sub-optimizer by it, the Muon
one included: the global clip of :mod:`megatron_eopt.clipping`, with its harm to orthogonalized
matrices (a coefficient that re-weights the momentum step to step, and that can push a matrix
below Newton–Schulz's normalization eps). :func:`patch` replaces that step with one that clips by
megatron_eopt's policies:

- ``"adamw"`` (the default): the sub-optimizers that are not orthogonalizing are clipped by the
  norm of their own gradients; the orthogonalizing ones (Muon, AdaptiveMuon, ...) are not clipped;
- ``"separate"``: each part clipped by its own norm;
- ``"global"``: Megatron-LM's own step, unchanged.

What stays Megatron's: ``prepare_grads`` (fp16 loss-scale unscaling and its inf check), the
gradients each sub-optimizer counts (``get_grads_for_grad_norm``: shared and tensor-parallel
duplicates left out), its separate grad-norm groups (MTP's parameters, clipped by their own group
norm), ``clip_grad`` per sub-optimizer config, ``grad_norm_skip_threshold`` (compared with the
total norm, as Megatron does), ``count_zeros`` and ``step_with_ready_grads``. The step returns
Megatron's triple with the total norm of all gradients, as a float.

The norms cost one all-reduce per reduction group (Megatron's: one per norm): each rank sums the
squares of its gradients per (part, grad-norm group) into one fixed-length vector, so every rank
issues the same collectives whatever it owns. A layer-wise optimizer's gradients are reduced over
the whole world (each rank owns whole parameters), any other sub-optimizer's over its
``get_grad_stats_parallel_group()``, DTensor gradients first over their mesh (FSDP2).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..clipping import CLIP_POLICIES, DEFAULT_CLIP_POLICY, is_orthogonalizing

__all__ = ["CONFIG_FIELD", "DEFAULT_POLICY", "check_policy", "patch", "policy", "unpatch"]

# An OptimizerConfig attribute of this name chooses the policy of the optimizers built from it.
CONFIG_FIELD = "muon_clip_policy"
DEFAULT_POLICY = DEFAULT_CLIP_POLICY

_STATE: dict[str, Any] = {"policy": DEFAULT_POLICY, "original": None, "chained": None}
_WORLD = object()  # stands for the default (world) process group as a reduction key


def check_policy(value: str, name: str = "clip_policy") -> str:
    if value not in CLIP_POLICIES:
        raise ValueError(f"{name} must be one of {CLIP_POLICIES}, got {value!r}")
    return value


def policy(config: Any = None) -> str:
    """The policy for ``config``: its ``muon_clip_policy`` attribute, else the installed one."""
    chosen = getattr(config, CONFIG_FIELD, None) if config is not None else None
    return _STATE["policy"] if chosen is None else check_policy(chosen, f"OptimizerConfig.{CONFIG_FIELD}")


class _Leaf(NamedTuple):
    optimizer: Any  # a Megatron optimizer around one torch optimizer
    config: Any  # the config whose clip_grad and skip threshold apply (the top-level child's)
    group: Any  # the process group its gradient norms are reduced over (_WORLD: the world)
    muon: bool


def _layer_wise_class() -> type | None:
    try:
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    except ImportError:
        return None
    return LayerWiseDistributedOptimizer


def _leaves(chained: Any) -> list[_Leaf]:
    """The sub-optimizers of ``chained``, nested chains (a layer-wise optimizer in a chain) flattened."""
    layer_wise = _layer_wise_class()
    leaves: list[_Leaf] = []

    def visit(opt: Any, config: Any, group: Any) -> None:
        # Megatron-LM's own flag on the empty optimizer it builds for a rank that holds no parameters of
        # that kind: nothing to clip there.
        if getattr(opt, "is_stub_optimizer", False):
            return
        children = getattr(opt, "chained_optimizers", None)
        if children is not None:
            if layer_wise is not None and isinstance(opt, layer_wise):
                group = _WORLD
            for child in children:
                visit(child, config, group)
            return
        if group is None:
            group = opt.get_grad_stats_parallel_group()
        leaves.append(_Leaf(opt, config, group, is_orthogonalizing(getattr(opt, "optimizer", None))))

    # Megatron reads clip_grad and the skip threshold from each of the step's own children.
    top_group = _WORLD if layer_wise is not None and isinstance(chained, layer_wise) else None
    for child in chained.chained_optimizers:
        visit(child, child.config, top_group)
    return leaves


def _separate_groups() -> tuple[str, ...]:
    from megatron.core.optimizer import optimizer as megatron_optimizer

    return tuple(getattr(megatron_optimizer, "SEPARATE_GRAD_NORM_GROUPS", ()))


def _grad_norm_group(param: torch.Tensor) -> str | None:
    return getattr(param, "grad_norm_group", None)


def _uses_decoupled_grad(leaf: _Leaf, params: list[torch.Tensor]) -> bool:
    """Megatron's rule for which attribute holds the gradient (precision-aware optimizer, Megatron-FSDP)."""
    config = leaf.optimizer.config
    return bool(getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False) or (
        getattr(config, "use_precision_aware_optimizer", False) and getattr(params[0], "__fsdp_param__", False)))


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` (their local shards), fp32, on the first gradient's device."""
    local = [_local(g) for g in grads]
    norms = torch._foreach_norm(local, 2, dtype=torch.float32)
    device = local[0].device
    return torch.stack([n.to(device) for n in norms]).square().sum()


def _reduce(values: torch.Tensor, group: Any) -> None:
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.SUM,
                                 group=None if group is _WORLD else group)


def _norm_slots(leaves: list[_Leaf], groups: tuple[str | None, ...]) -> tuple[int, list[float]]:
    """Per reduction group, per (part, grad-norm group): the global sum of squares and the
    parameter count (to tell an empty group from a zero one). One host read at the end."""
    order: list[Any] = []  # reduction groups in first-seen order (the same on every rank)
    for leaf in leaves:
        if not any(leaf.group is g for g in order):
            order.append(leaf.group)
    width = 2 * len(groups)
    totals = []
    for group in order:
        members = [leaf for leaf in leaves if leaf.group is group]
        device = _device(members)
        plain = torch.zeros(2 * width, dtype=torch.float32, device=device)
        sharded = torch.zeros_like(plain)
        mesh_group = None
        for leaf in members:
            for gi, name in enumerate(groups):
                grads = leaf.optimizer.get_grads_for_grad_norm(name) if name is not None \
                    else leaf.optimizer.get_grads_for_grad_norm()
                if not grads:
                    continue
                slot = (0 if leaf.muon else width) + 2 * gi
                for is_dtensor in (False, True):
                    part = [g for g in grads if hasattr(g, "device_mesh") == is_dtensor]
                    if not part:
                        continue
                    target = sharded if is_dtensor else plain
                    if is_dtensor:
                        mesh_group = part[0].device_mesh.get_group()
                    target[slot] += _squares(part).to(device)
                    target[slot + 1] += len(part)
        if mesh_group is not None:  # FSDP2 shards: sum over their mesh first, as Megatron does
            _reduce(sharded, mesh_group)
        plain += sharded
        _reduce(plain, group)
        totals.append(plain)
    flat = torch.cat(totals).tolist() if totals else []
    return len(order), flat


def _device(leaves: list[_Leaf]) -> torch.device:
    for leaf in leaves:
        for p in leaf.optimizer.get_parameters():
            return _local(p).device
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _part_norms(flat: list[float], n_reduction_groups: int, groups: tuple[str | None, ...]
                ) -> dict[tuple[bool, str | None], tuple[float, float]]:
    """{(muon, grad-norm group): (norm, parameter count)} summed over the reduction groups."""
    width = 2 * len(groups)
    sums: dict[tuple[bool, str | None], list[float]] = {}
    for r in range(n_reduction_groups):
        base = r * 2 * width
        for muon in (True, False):
            for gi, name in enumerate(groups):
                at = base + (0 if muon else width) + 2 * gi
                acc = sums.setdefault((muon, name), [0.0, 0.0])
                acc[0] += flat[at]
                acc[1] += flat[at + 1]
    return {key: (math.sqrt(s), c) for key, (s, c) in sums.items()}


def _clip(params: list[torch.Tensor], max_norm: float, norm: float, decoupled: bool) -> None:
    """Megatron's coefficient, ``max_norm / (norm + 1e-6)``, when below 1; a non-finite norm clips
    nothing (as Megatron's float comparison does)."""
    if not params or not math.isfinite(norm):
        return
    coefficient = max_norm / (norm + 1.0e-6)
    if coefficient >= 1.0:
        return
    grads = [getattr(p, "decoupled_grad", None) if decoupled else p.grad for p in params]
    grads = [_local(g).detach() for g in grads if g is not None]
    if grads:
        torch._foreach_mul_(grads, coefficient)


@torch.no_grad()
def muon_aware_step(self: Any) -> tuple[bool, float | None, Any]:
    """``ChainedOptimizer.step`` with the gradients clipped by megatron_eopt's policy."""
    leaves = _leaves(self)
    chosen = policy(self.config)
    if chosen == "global" or not any(leaf.muon for leaf in leaves):
        return _STATE["original"](self)
    self.grad_norms_by_group = {}
    if self.prepare_grads():
        return False, None, None

    groups = (None, *_separate_groups())
    n_reduction_groups, flat = _norm_slots(leaves, groups)
    parts = _part_norms(flat, n_reduction_groups, groups)
    muon_norm = parts[(True, None)][0]
    adamw_norm = parts[(False, None)][0]
    total = math.sqrt(muon_norm**2 + adamw_norm**2)
    for name in groups[1:]:
        (m, mc), (a, ac) = parts[(True, name)], parts[(False, name)]
        if mc + ac > 0:
            self.grad_norms_by_group[name] = math.sqrt(m**2 + a**2)
    self.grad_norms_by_part = {"muon": muon_norm, "adamw": adamw_norm}

    should_skip = False
    for leaf in leaves:
        params = leaf.optimizer.get_parameters()
        if not params:
            continue
        main = [p for p in params if _grad_norm_group(p) is None]
        clip_grad = leaf.config.clip_grad
        if clip_grad > 0.0 and (not leaf.muon or chosen == "separate"):
            decoupled = _uses_decoupled_grad(leaf, params)
            _clip(main, clip_grad, parts[(leaf.muon, None)][0], decoupled)
            for name in groups[1:]:
                members = [p for p in params if _grad_norm_group(p) == name]
                _clip(members, clip_grad, parts[(leaf.muon, name)][0], decoupled)
        threshold = leaf.config.grad_norm_skip_threshold
        if main and math.isfinite(threshold) and total > threshold:
            should_skip = True

    num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
    success = False if should_skip else self.step_with_ready_grads()
    return success, total, num_zeros


def patch(chained_class: type, clip_policy: str | None) -> None:
    """Makes ``chained_class.step`` clip by ``clip_policy`` (None: the current one; idempotent)."""
    if clip_policy is not None:
        _STATE["policy"] = check_policy(clip_policy)
    if _STATE["original"] is None:
        _STATE["original"] = chained_class.step
        _STATE["chained"] = chained_class
        chained_class.step = muon_aware_step


def unpatch() -> None:
    """Puts Megatron-LM's own ``ChainedOptimizer.step`` back."""
    if _STATE["original"] is not None:
        _STATE["chained"].step = _STATE["original"]
    _STATE.update(policy=DEFAULT_POLICY, original=None, chained=None)
