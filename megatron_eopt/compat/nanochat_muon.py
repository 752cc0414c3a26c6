"""nanochat's ``Muon`` and ``DistMuon`` (``nanochat/muon.py`` at 22a71aa, January–July 2026) on the fused step.

Polar Express with a 1.02 divisor, NorMuon-style variance reduction ``beta2``, cautious weight
decay, in bf16 on every device (``nanochat_stacked.ERA_2201``); state stacked per shape group as
``nanochat_stacked`` describes. Param groups are nanochat's: one per distinct shape, in sorted
shape order; ``DistMuon`` adds each group's ``chunk_size``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from ..step_stats import StepStatsReporter, records_step_stats
from .nanochat_stacked import ERA_2201, _check_values, _muon_distributed_step, _RecipeState, _StackedMuon, _world


def _groups_by_shape(params: Iterable[torch.Tensor], where: str) -> list[list[torch.Tensor]]:
    params = list(params)
    for i, p in enumerate(params):
        if p.ndim != 2:
            raise ValueError(f"{where}: params[{i}] has shape {tuple(p.shape)}; Muon takes 2-D parameters only")
    return [[p for p in params if p.shape == shape] for shape in sorted({p.shape for p in params})]


class _NanochatMuonBase(_RecipeState, StepStatsReporter, torch.optim.Optimizer):
    """Muon / DistMuon of 22a71aa: groups by sorted shape, stacked state on each group's first param."""

    orthogonalizing = True  # its parameters are "the Muon part" of a clip (megatron_eopt.clipping)

    _distributed = False

    def __init__(self, params, lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.0) -> None:
        name = type(self).__name__
        groups = _groups_by_shape(params, name)
        if not groups:
            raise ValueError(f"{name} got no parameters")
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, beta2=beta2, weight_decay=weight_decay)
        _check_values(defaults, name)
        if self._distributed:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("DistMuon needs torch.distributed to be initialized (init_process_group)")
            world = dist.get_world_size()
            param_groups = [dict(params=g, chunk_size=(len(g) + world - 1) // world) for g in groups]
        else:
            param_groups = [dict(params=g) for g in groups]
        self._muon = _StackedMuon(ERA_2201, "medium")  # 22a71aa iterates in bf16 on every device
        super().__init__(param_groups, defaults)
        self._muon.prepare(self.param_groups, self.state, *self._world(), create_state=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_muon"):  # after construction: the inner optimizers follow the groups
            self._muon.prepare(self.param_groups, self.state, *self._world(), create_state=False)

    def _restored(self) -> None:
        self._muon.prepare(self.param_groups, self.state, *self._world(), create_state=False)

    def _world(self) -> tuple[int, int]:
        return _world() if self._distributed else (0, 1)

    def _expected_state(self, p, key):
        _, world = self._world()
        for group in self.param_groups:
            if group["params"][0] is p:
                shape = self._muon.state_shapes(group, world).get(key)
                return None if shape is None else (shape, p.dtype)
        return None

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates every group's stacks (zeros) up front, as the first step would (checkpoint loading)."""
        self._muon.prepare(self.param_groups, self.state, *self._world())

    @torch.no_grad()
    @records_step_stats
    def step(self):
        rank, world = self._world()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    raise RuntimeError(f"{type(self).__name__} needs a grad for every parameter (as nanochat's): "
                                       f"param_groups[{gi}]['params'][{pi}] has none")
        if world == 1:
            self._muon.step(self.param_groups, self.state, rank, world)
            return
        _muon_distributed_step(self._muon, self.param_groups, self.state, rank, world)


class Muon(_NanochatMuonBase):
    """nanochat's ``Muon`` at 22a71aa: ``Muon(params, lr=0.02, momentum=0.95, ns_steps=5,
    beta2=0.95, weight_decay=0.0)`` for 2-D parameters (the step: ``nanochat_stacked``)."""


class DistMuon(_NanochatMuonBase):
    """nanochat's ``DistMuon`` at 22a71aa: every rank holds all parameters and its own grads; per
    shape group the stacked grads are reduce-scattered (mean), rank r steps its contiguous chunk of
    ``chunk_size = ceil(len / world_size)`` parameters and keeps their state, and an all-gather
    shares the new values. Each rank's ``state_dict()`` loads into nanochat's DistMuon on the
    same rank of the same world size, and back."""

    _distributed = True
