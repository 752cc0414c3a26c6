"""TensorParallelMuonHT: Muon Hyperball on tensor-parallel shards (Megatron-LM's ``muon_ht``, PR #6422).

The hyperball rule ``W ← R·normalize(W − lr·R·normalize(update))`` takes Frobenius norms of the
logical matrix, not of the local shard: a parameter split over a tensor-parallel group (``tp``, or
``expt_tp`` for experts) and / or over a GTP weight-rematerialization group (``gtp_remat`` /
``expt_gtp_remat``) sums the squares of its shards over each of those groups in turn (they are
orthogonal axes of the same matrix, so the sums in sequence cover their product). Replica-only axes
(data parallel, a TP group over a parameter it does not shard) are not reduced: that would count
identical copies more than once.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .. import _collectives as collectives
from .tensor_parallel import TensorParallelMuon
from .weight_update_hooks import HyperballHook

__all__ = ["ShardedHyperballHook", "TensorParallelMuonHT", "logical_frobenius_norms", "shard_groups"]


def _is_expert(p: torch.Tensor) -> bool:
    # Megatron-LM's expert parameters: tagged expert_tp, or excluded from the dense all-reduce.
    return bool(getattr(p, "expert_tp", False) or not getattr(p, "allreduce", True))


def _is_tp_sharded(p: torch.Tensor) -> bool:
    flag = getattr(p, "tensor_model_parallel", None)
    if flag is not None:
        return bool(flag)
    return getattr(p, "partition_dim", None) not in (None, -1)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def shard_groups(p: torch.Tensor, pg_collection: Any) -> tuple:
    """The process groups over which ``p``'s shards are distinct parts of one matrix (each of size > 1):
    its tensor-parallel group if it is TP-sharded, then its GTP group if it is GTP-sharded. ValueError
    naming the group when a sharded parameter's group is missing from ``pg_collection``."""
    expert = _is_expert(p)
    groups = []
    if _is_tp_sharded(p):
        name = "expt_tp" if expert else "tp"
        group = getattr(pg_collection, name, None)
        if group is None:
            raise ValueError(f"TensorParallelMuonHT: a tensor-parallel parameter of shape {tuple(p.shape)} needs "
                             f"pg_collection.{name}, which is missing")
        if _size(group) > 1:
            groups.append(group)
    if getattr(p, "is_gtp_weight_remat", False):
        name = "expt_gtp_remat" if expert else "gtp_remat"
        group = getattr(pg_collection, name, None)
        if group is None:
            raise ValueError(f"TensorParallelMuonHT: a GTP-sharded parameter of shape {tuple(p.shape)} needs "
                             f"pg_collection.{name}, which is missing")
        if _size(group) > 1 and all(group is not g for g in groups):
            groups.append(group)
    return tuple(groups)


def logical_frobenius_norms(tensors: Sequence[torch.Tensor], groups: Sequence[tuple]) -> list[torch.Tensor]:
    """fp32 Frobenius norms of the logical matrices whose local shards are ``tensors``, ``groups[i]``
    the groups to sum tensor i's squares over. One all-reduce per distinct group, over a vector of
    the squares of every tensor that needs it (the same calls on every rank holding the same
    parameters, in the same order)."""
    squares = [t.float().square().sum() for t in tensors]
    by_groups: dict[tuple, list[int]] = {}
    for i, gs in enumerate(groups):
        if gs:
            by_groups.setdefault(tuple(id(g) for g in gs), []).append(i)
    for index in by_groups.values():
        flat = torch.stack([squares[i] for i in index])
        for group in groups[index[0]]:
            collectives.all_reduce(flat, group=group)
        for j, i in enumerate(index):
            squares[i] = flat[j]
    return [s.sqrt() for s in squares]


class ShardedHyperballHook(HyperballHook):
    """:class:`~megatron_eopt.optim.weight_update_hooks.HyperballHook` whose norms are those of the
    logical matrices (:func:`logical_frobenius_norms`); ``groups_of(p)`` gives a parameter's groups."""

    def __init__(self, radius: float, eps: float, groups_of: Callable[[torch.Tensor], tuple]) -> None:
        super().__init__(radius, eps)
        self._groups_of = groups_of

    def _project_(self, params: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        norms = logical_frobenius_norms(tensors, [self._groups_of(p) for p in params])
        torch._foreach_mul_(tensors, [self._factor(n).to(t.dtype) for n, t in zip(norms, tensors)])

    def pre_weight_update_inplace(self, p: torch.Tensor, update: torch.Tensor) -> None:
        self._project_([p], [update])

    def post_weight_update_inplace(self, p: torch.Tensor, pre_update_state: None) -> None:
        self._project_([p], [p])

    def fused_pre(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        self._project_(params, updates)

    def fused_post(self, params: list[torch.Tensor], state: None) -> None:
        self._project_(params, params)


def _check_radius(radius: Any, eps: Any) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"hyperball_eps must be finite and positive, got {eps!r}")
    if radius is None:
        raise ValueError("TensorParallelMuonHT requires hyperball_radius (Megatron-LM: muon_ht_radius), the "
                         "Frobenius norm every Muon matrix is kept at")
    if isinstance(radius, bool) or not isinstance(radius, (int, float)) or not math.isfinite(radius) or radius < eps:
        raise ValueError(f"hyperball_radius must be finite and at least hyperball_eps={eps}, got {radius!r}")


def _check_no_weight_decay(wd: Any, where: str) -> None:
    if bool(wd != 0.0):
        raise ValueError(
            f"TensorParallelMuonHT requires weight_decay == 0 (the hyperball projection replaces weight decay; "
            f"Megatron-LM: --weight-decay 0), got {where} = {float(wd)}")


class TensorParallelMuonHT(TensorParallelMuon):
    """Megatron-LM's ``TensorParallelMuonHT`` (``optimizer="muon_ht"``): :class:`TensorParallelMuon`
    whose update is rescaled to the radius and whose weight is projected back onto it after the step,
    ``W ← R·normalize(W − lr·R·normalize(update))``, every norm the logical matrix's
    (:func:`logical_frobenius_norms`: summed over the TP / expert-TP and GTP shards of the parameter,
    never over replicas). A norm below ``hyperball_eps`` counts as zero (that tensor becomes 0).

    ``hyperball_radius`` (required) is the fixed radius ``R`` of every matrix, ``hyperball_eps``
    (default 1e-15) the floor. ``weight_decay`` must be 0 (the default here), in the constructor and
    in every param group: ValueError naming it otherwise. ``pg_collection`` is required (Megatron's
    ``ProcessGroupCollection``; a sharded parameter whose group it lacks is refused). The weights
    are not rescaled at construction: Megatron-LM puts them on the sphere when it initializes the
    model, and the first step's projection does otherwise. Other arguments as
    :class:`TensorParallelMuon`; every ``tp_mode`` works (the norms do not depend on it).
    """

    def __init__(self, params, *args: Any, hyperball_radius: float | None = None, hyperball_eps: float = 1e-15,
                 **kwargs: Any) -> None:
        import inspect

        bound = inspect.signature(TensorParallelMuon.__init__).bind(self, params, *args, **kwargs)
        arguments = bound.arguments
        arguments.setdefault("weight_decay", 0.0)
        _check_no_weight_decay(arguments["weight_decay"], "weight_decay")
        _check_radius(hyperball_radius, hyperball_eps)
        if arguments.get("pg_collection") is None:
            raise ValueError("TensorParallelMuonHT requires pg_collection (Megatron's ProcessGroupCollection): its "
                             "norms are summed over the parameters' tensor-parallel and GTP groups")
        arguments.pop("self")
        super().__init__(**arguments)
        for gi, group in enumerate(self.param_groups):
            _check_no_weight_decay(group["weight_decay"], f"param_groups[{gi}]['weight_decay']")
        self.hyperball_radius = float(hyperball_radius)
        self.hyperball_eps = float(hyperball_eps)
        pg = self.pg_collection
        for p in (p for group in self.param_groups for p in group["params"]):
            shard_groups(p, pg)  # refuses a sharded parameter without its group, at construction
        # The fused step runs the hook batched per bucket (weight_update_hooks: fused_pre / fused_post).
        self._weight_update_hook = ShardedHyperballHook(self.hyperball_radius, self.hyperball_eps,
                                                        lambda p: shard_groups(p, pg))

    def add_param_group(self, param_group: dict) -> None:
        if "weight_decay" in param_group:
            _check_no_weight_decay(param_group["weight_decay"], "param_group['weight_decay']")
        super().add_param_group(param_group)
