"""Gradient clipping that knows which parameters Muon orthogonalizes.

A global clip (``torch.nn.utils.clip_grad_norm_``) multiplies every gradient by one coefficient
that changes from step to step. For the matrices an orthogonalized optimizer updates this is at
best useless (Newton–Schulz normalizes the scale away) and at worst harmful: the coefficient
re-weights old against new gradients in the momentum buffer, and a tiny coefficient can push a
matrix below Newton–Schulz's normalization eps, where the orthogonalized step degenerates.

:func:`clip_grad_norm_` takes torch's arguments and returns torch's total norm, plus a ``policy``:

- ``"global"``: torch's behaviour, every gradient clipped by the norm of all gradients;
- ``"adamw"`` (the default): the returned norm still covers every gradient, but only the
  gradients of the element-wise optimized parameters (AdamW's) are clipped, by the norm of
  their own gradients; the orthogonalized matrices' gradients are left as they are;
- ``"separate"``: each part clipped by its own norm.

The "Muon part" is read from what is passed: the parameters of an orthogonalized optimizer (a class
that declares ``orthogonalizing = True``: ``megatron_eopt.optim``'s classes, the snippet's and
nanochat's ``Muon`` / ``DistMuon``; and ``torch.optim.Muon`` and Emerging-Optimizers' classes,
which cannot declare it), of ``use_muon=True`` groups (``HybridMuon`` and its compat classes)
and of ``kind="muon"`` groups (nanochat's ``MuonAdamW``); any other optimizer's parameters are
the AdamW part. Plain parameters need ``muon_params``: a collection of tensors, or a
:class:`megatron_eopt.RoutingTable` with the parameters passed by name (a module, a
``{name: param}`` dict or ``(name, param)`` pairs).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, NamedTuple

import torch

__all__ = ["CLIP_POLICIES", "DEFAULT_CLIP_POLICY", "GradNorms", "clip_grad_norm_", "is_orthogonalizing"]

CLIP_POLICIES = ("global", "adamw", "separate")
# The policy of clip_grad_norm_, of Megatron-LM's clip under install() and of MuonClipTrainer.
DEFAULT_CLIP_POLICY = "adamw"


class GradNorms(NamedTuple):
    """Gradient norms of one :func:`clip_grad_norm_` call, before clipping, as 0-D tensors.

    ``total``: every gradient (torch's return value); ``muon``: the orthogonalized matrices';
    ``adamw``: the element-wise optimized parameters'. An empty part's norm is 0."""

    total: torch.Tensor
    muon: torch.Tensor
    adamw: torch.Tensor


# Orthogonalizing classes that cannot declare it: Emerging-Optimizers' base class (Megatron-LM's
# stock Muon), looked up only where that package is already imported (an optimizer of it exists
# only then), and torch's own Muon.
_EO_ORTHOGONALIZED = ("emerging_optimizers.orthogonalized_optimizers.orthogonalized_optimizer", "OrthogonalizedOptimizer")


def _foreign_orthogonalizing() -> tuple[type, ...]:
    classes = []
    torch_muon = getattr(torch.optim, "Muon", None)
    if isinstance(torch_muon, type):
        classes.append(torch_muon)
    eo = getattr(sys.modules.get(_EO_ORTHOGONALIZED[0]), _EO_ORTHOGONALIZED[1], None)
    if isinstance(eo, type):
        classes.append(eo)
    return tuple(classes)


def is_orthogonalizing(optimizer: Any) -> bool:
    """True when ``optimizer`` orthogonalizes all its parameters (its params are "the Muon part"
    unless its groups say otherwise): its class declares ``orthogonalizing = True``, or it is a
    ``torch.optim.Muon`` or an Emerging-Optimizers orthogonalized optimizer."""
    return bool(getattr(type(optimizer), "orthogonalizing", False)) or isinstance(optimizer, _foreign_orthogonalizing())


def orthogonalizing_classes() -> tuple[type, ...]:
    """Deprecated: use :func:`is_orthogonalizing` (classes declare ``orthogonalizing = True``).
    The loaded classes that declare it, and torch's and Emerging-Optimizers' orthogonalized ones."""
    warnings.warn("megatron_eopt.clipping.orthogonalizing_classes is deprecated: use is_orthogonalizing(optimizer)",
                  DeprecationWarning, stacklevel=2)
    found, todo = [], [torch.optim.Optimizer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return tuple(c for c in found if c.__dict__.get("orthogonalizing", False)) + _foreign_orthogonalizing()


def _is_muon_group(optimizer: torch.optim.Optimizer, group: dict, whole: bool) -> bool:
    if "use_muon" in group:
        return bool(group["use_muon"])
    if "kind" in group and group["kind"] in ("muon", "adamw"):
        return group["kind"] == "muon"
    return whole


def _optimizer_params(optimizers: list[torch.optim.Optimizer]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    muon: list[torch.Tensor] = []
    other: list[torch.Tensor] = []
    for opt in optimizers:
        whole = is_orthogonalizing(opt)
        for group in opt.param_groups:
            (muon if _is_muon_group(opt, group, whole) else other).extend(group["params"])
    return muon, other


def _named(parameters: Any) -> list[tuple[str, torch.Tensor]] | None:
    if isinstance(parameters, torch.nn.Module):
        return list(parameters.named_parameters())
    if isinstance(parameters, dict):
        return list(parameters.items())
    return None


def _as_optimizers(obj: Any) -> list[torch.optim.Optimizer] | None:
    if isinstance(obj, torch.optim.Optimizer):
        return [obj]
    if isinstance(obj, (list, tuple)) and obj:
        # build_optimizers' return value: ([muon, adamw], table), or the list alone
        if len(obj) == 2 and isinstance(obj[0], (list, tuple)) and not isinstance(obj[1], torch.Tensor) \
                and all(isinstance(o, torch.optim.Optimizer) for o in obj[0]):
            return list(obj[0])
        if all(isinstance(o, torch.optim.Optimizer) for o in obj):
            return list(obj)
    return None


def muon_and_other_params(parameters_or_optimizers: Any, muon_params: Any = None
                          ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.optim.Optimizer]]:
    """Deprecated (unused by the package; to be removed). ``(muon_params, other_params, optimizers)``
    as :func:`clip_grad_norm_` splits its input; each parameter once, in the order given."""
    warnings.warn("megatron_eopt.clipping.muon_and_other_params is deprecated and will be removed",
                  DeprecationWarning, stacklevel=2)
    ordered, muon_ids, optimizers = _split(parameters_or_optimizers, muon_params)
    return ([p for p in ordered if id(p) in muon_ids], [p for p in ordered if id(p) not in muon_ids], optimizers)


def _split(parameters_or_optimizers: Any, muon_params: Any
           ) -> tuple[list[torch.Tensor], set[int], list[torch.optim.Optimizer]]:
    optimizers = _as_optimizers(parameters_or_optimizers)
    if optimizers is not None:
        if muon_params is not None:
            raise ValueError("muon_params is for plain parameters: with optimizers, their classes and groups say "
                             "which parameters are orthogonalized")
        muon, other = _optimizer_params(optimizers)
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        muon_ids = {id(p) for p in muon}
    else:
        optimizers = []
        named = _named(parameters_or_optimizers)
        if named is None:
            if isinstance(parameters_or_optimizers, torch.Tensor):
                parameters_or_optimizers = [parameters_or_optimizers]
            items = list(parameters_or_optimizers)
            if items and isinstance(items[0], tuple):
                named = items
        if named is not None:
            params = [p for _, p in named]
        else:
            params = items
        from .param_routing import RoutingTable

        if muon_params is None:
            muon_ids: set[int] = set()
        elif isinstance(muon_params, RoutingTable):
            if named is None:
                raise ValueError("muon_params=RoutingTable needs the parameters by name: pass the module, a "
                                 "{name: param} dict or (name, param) pairs")
            names = set()
            for route in muon_params:
                if route.optimizer == "muon":
                    names.update(route.names)
            muon_ids = {id(p) for n, p in named if n in names}
        else:
            if isinstance(muon_params, torch.Tensor):
                muon_params = [muon_params]
            muon_ids = {id(p) for p in muon_params}
    seen: set[int] = set()
    ordered = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            ordered.append(p)
    return ordered, muon_ids, optimizers


def _norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor | None:
    """torch's total norm of ``grads``; DTensor gradients grouped by mesh (torch stacks the per-tensor
    norms, which needs one mesh) and each group's norm reduced over its mesh (``full_tensor``)."""
    if not grads:
        return None
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(getattr(g, "device_mesh", None), []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, False, foreach)
        full = getattr(norm, "full_tensor", None)
        norms.append(full() if full is not None else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


def _combine(a: torch.Tensor | None, b: torch.Tensor | None, norm_type: float) -> torch.Tensor:
    if a is None or b is None:
        return a if b is None else b
    b = b.to(a.device)
    return torch.linalg.vector_norm(torch.stack([a, b]), norm_type)


def _clip(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor | None, foreach: bool | None) -> None:
    if norm is None or not params:
        return
    # A non-finite norm (an overflow) clips nothing: the norm is replaced by 0, whose coefficient
    # torch clamps to 1. A device-side where, so no host sync.
    safe = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))
    # torch clips one list with one foreach multiply, which cannot mix plain tensors with DTensors or
    # DTensors of two meshes: one call per mesh (None: plain tensors), as _norm groups them.
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, safe, foreach)


def _unless_overflow(norm: torch.Tensor | None, total: torch.Tensor) -> torch.Tensor | None:
    """``norm``, or the non-finite ``total`` (which clips nothing) when the total overflowed."""
    if norm is None:
        return None
    total = total.to(norm.device)
    return torch.where(torch.isfinite(total), norm, total)


def _unscale(grad_scaler: Any, optimizers: list[torch.optim.Optimizer]) -> None:
    from torch.amp.grad_scaler import OptState

    for opt in optimizers:
        state = getattr(grad_scaler, "_per_optimizer_states", {}).get(id(opt))
        if state is not None and state.get("stage") is OptState.UNSCALED:
            continue  # the caller unscaled it already (torch's recipe): do not unscale twice
        grad_scaler.unscale_(opt)


def _refuse_started_overlap(optimizers: list[torch.optim.Optimizer], policy: str) -> None:
    """A policy that scales the orthogonalized gradients cannot follow an optimizer whose backward
    already consumed them (``overlap_backward=True``): refused before anything is clipped."""
    for opt in optimizers:
        work = getattr(opt.__dict__.get("_overlap"), "work", None)
        if work is not None and work.versions:
            raise ValueError(
                f"policy={policy!r} scales the gradients of {type(opt).__name__}'s matrices, whose Newton–Schulz "
                "started during backward (overlap_backward=True): clip with policy='adamw' (those gradients "
                "untouched), or construct the optimizer with overlap_backward=False"
            )


def clip_grad_norm_(
    parameters_or_optimizers: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    policy: str = DEFAULT_CLIP_POLICY,
    muon_params: Any = None,
    grad_scaler: Any = None,
    return_parts: bool = False,
) -> torch.Tensor | GradNorms:
    """Clips gradients by norm, leaving orthogonalized matrices' gradients alone by default.

    ``parameters_or_optimizers``: an optimizer, a list of optimizers, :func:`build_optimizers`'
    ``(optimizers, table)`` pair, or plain parameters (tensors, ``(name, param)`` pairs, a
    ``{name: param}`` dict or a module) with ``muon_params`` naming the orthogonalized ones (a
    collection of tensors or a :class:`RoutingTable`). ``max_norm``, ``norm_type``,
    ``error_if_nonfinite`` and ``foreach`` are torch's.

    ``policy``: ``"global"`` (torch's clip), ``"adamw"`` (only the element-wise optimized
    parameters, by their own norm) or ``"separate"`` (each part by its own norm).

    ``grad_scaler``: a ``torch.amp.GradScaler``; the optimizers are unscaled first (those the
    caller unscaled already are not unscaled twice). On an overflow nothing is clipped, the
    non-finite norm is returned and ``error_if_nonfinite`` is not raised: the scaler's ``step``
    skips the step.

    Returns the total norm of all gradients before clipping, a 0-D tensor (torch's return
    value), or with ``return_parts=True`` a :class:`GradNorms` ``(total, muon, adamw)``. Norms
    are computed with torch's foreach kernels, one launch per device and dtype, and nothing
    waits on the device unless ``error_if_nonfinite=True`` (which must read the norm).
    """
    if policy not in CLIP_POLICIES:
        raise ValueError(f"policy must be one of {CLIP_POLICIES}, got {policy!r}")
    ordered, muon_ids, optimizers = _split(parameters_or_optimizers, muon_params)
    if policy != "global" and not optimizers and muon_params is None:
        raise ValueError(f"policy={policy!r} with plain parameters needs muon_params (the orthogonalized "
                         "parameters, or a RoutingTable); or pass the optimizers, or use policy='global'")
    if policy != "adamw":
        _refuse_started_overlap(optimizers, policy)
    if grad_scaler is not None and getattr(grad_scaler, "is_enabled", lambda: True)():
        if not optimizers:
            raise ValueError("grad_scaler needs the optimizers (the scaler unscales per optimizer)")
        _unscale(grad_scaler, optimizers)
        error_if_nonfinite = False
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    ordered = [p for p in ordered if p.grad is not None]
    muon = [p for p in ordered if id(p) in muon_ids]
    other = [p for p in ordered if id(p) not in muon_ids]
    muon_grads = [p.grad for p in muon]
    other_grads = [p.grad for p in other]

    if policy == "global" and not return_parts:
        total = _norm([p.grad for p in ordered], norm_type, foreach)
        muon_norm = other_norm = None
    else:
        muon_norm = _norm(muon_grads, norm_type, foreach)
        other_norm = _norm(other_grads, norm_type, foreach)
        if policy == "global":  # torch's total, bit for bit (same tensors, same order)
            total = _norm([p.grad for p in ordered], norm_type, foreach)
        else:
            total = _combine(muon_norm, other_norm, norm_type)
    if total is None:
        total = torch.tensor(0.0)
    if error_if_nonfinite:
        if bool(torch.logical_or(total.isnan(), total.isinf())):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error (nothing is clipped then), set "
                               "`error_if_nonfinite=False`")

    if policy == "global":
        _clip(ordered, max_norm, total, foreach)
    else:  # an overflow anywhere clips nothing, as under the global clip
        if policy == "separate":
            _clip(muon, max_norm, _unless_overflow(muon_norm, total), foreach)
        _clip(other, max_norm, _unless_overflow(other_norm, total), foreach)

    if not return_parts:
        return total
    zero = torch.zeros((), dtype=total.dtype, device=total.device)
    return GradNorms(total, zero if muon_norm is None else muon_norm, zero if other_norm is None else other_norm)
