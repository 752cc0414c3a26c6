"""nanochat's optimizers since January 2026 (served by ``megatron_eopt.nanochat``), on the fused
:class:`megatron_eopt.optim.AdaptiveMuon` and torch's AdamW kernels.

- :class:`Muon`, :class:`DistMuon`: ``nanochat/muon.py`` at 22a71aa (January–July 2026);
- :class:`MuonAdamW`: ``nanochat/optim.py`` as of a9d0a86 (July 2026), single process and
  distributed (ZeRO-2 style sharding when a multi-rank process group is initialized).

Each class keeps nanochat's param groups, group keys and state layout, so checkpoints load in both
directions: Muon groups hold one shape each and their state sits on the group's first parameter,
stacked, ``momentum_buffer`` (k, m, n) and ``second_momentum_buffer`` (k, m, 1) for m ≥ n else
(k, 1, n), in the parameters' dtype, where k is the group's size on one process or, distributed,
the rank's chunk ``ceil(len / world_size)`` (rank r owns the r-th contiguous chunk). The fused
optimizer works on views of those stacks.

The step of a Muon group (the recipe of that era; "today" adds what the later commits added):
Nesterov momentum ``M ← lerp(M, g, 1-momentum)``, ``G = lerp(g, M, momentum)``; today: MuonEq row
equilibration; Polar Express (nanochat's five rows, the first ``ns_steps``) after dividing by
``s·‖X‖ + 1e-6`` (s = 1.02 at 22a71aa, 1.01 today), in bf16 at 22a71aa and today in the compute
dtype (:func:`compute_dtype`); today: Muon+ renormalization to √min(m, n); variance reduction
(NorMuon with a 1e-10 floor: ``AdaptiveMuon(moment2_method="normuon", eps=1e-10)``; ``beta2=None``
is 0); cautious weight decay and the update with ``lr·√max(1, m/n)`` for both.

The single-process steps run under ``torch.compile(fullgraph=True)``: the fused optimizers and
their state views are built outside the step (see :class:`_StackedMuon`), and a compiled AdamW
step takes its lr and step count as tensors.
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.optim.adam import adam as adam_functional

from .. import _collectives as collectives
from ..step_stats import StepStatsReporter, records_step_stats
from ..optim._config import check_group_hyperparameters
from ..optim.step.state_check import check_loaded_state

# nanochat's Polar Express rows (computed for 5 iterations, safety factor 2e-2, cushion 2; arXiv
# 2505.16932); a step runs the first ns_steps of them.
NANOCHAT_POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NS_EPS = 1e-6  # nanochat's eps of the ||X|| normalization
VARIANCE_FLOOR = 1e-10  # nanochat's floor of the variance statistic and of the renormalization
SMALL_ADAMW_NUMEL = 1024  # distributed AdamW: smaller params are all-reduced, not sharded

# The two eras' Muon recipes as options of the fused AdaptiveMuon (see the module docstring).
ERA_2201 = dict(ns_norm_divisor=1.02)
ERA_TODAY = dict(ns_norm_divisor=1.01, row_equilibration=True, frobenius_renorm=True)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def compute_dtype() -> torch.dtype:
    """nanochat's ``COMPUTE_DTYPE``: ``NANOCHAT_DTYPE`` if set, else bf16 on a CUDA GPU of compute
    capability 8.0 or newer, else fp32 (older GPUs, CPU, MPS)."""
    env = os.environ.get("NANOCHAT_DTYPE")
    if env is not None:
        if env not in _DTYPES:
            raise ValueError(f"NANOCHAT_DTYPE must be one of {list(_DTYPES)}, got {env!r}")
        return _DTYPES[env]
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        return torch.bfloat16
    return torch.float32


def _precision(dtype: torch.dtype) -> str:
    # bf16 products accumulated in fp32 ("medium") or fp32 products; fp16 runs as bf16 here (the
    # fused op has no fp16 iteration, and nanochat itself calls fp16 unstable for it).
    return "highest" if dtype == torch.float32 else "medium"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_values(group: dict, where: str) -> None:
    """Range checks of a group's numbers at construction (ValueError naming the key)."""
    values = {k: group[k] for k in ("lr", "momentum", "weight_decay", "eps") if k in group}
    if group.get("beta2") is not None:  # None: no memory, as nanochat
        values["beta2"] = group["beta2"]
    check_group_hyperparameters(values, where)
    if "betas" in group:
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise ValueError(f"{where}['betas'] must be two numbers in [0, 1), got {betas!r}")
    if "ns_steps" in group and (isinstance(group["ns_steps"], bool) or not isinstance(group["ns_steps"], int)
                                or group["ns_steps"] < 1):
        raise ValueError(f"{where}['ns_steps'] must be a positive int, got {group['ns_steps']!r}")


def _groups_by_shape(params: Iterable[torch.Tensor], where: str) -> list[list[torch.Tensor]]:
    params = list(params)
    for i, p in enumerate(params):
        if p.ndim != 2:
            raise ValueError(f"{where}: params[{i}] has shape {tuple(p.shape)}; Muon takes 2-D parameters only")
    return [[p for p in params if p.shape == shape] for shape in sorted({p.shape for p in params})]


_IDLE_INNER_VALUES = dict(lr=0.0, momentum=0.0, weight_decay=0.0, beta2=0.0)  # the inner groups between steps


class _StackedMuon:
    """The Muon side: nanochat's stacked per-group state stepped by fused AdaptiveMuon optimizers
    (one per distinct ``ns_steps``) over the owned parameters.

    ``groups`` are the (outer) param-group dicts, each of one shape; a rank owns, in group g,
    the parameters ``[start, start + count)`` with a state stack of ``chunk`` rows.

    The inner optimizers and their state (views of the stacks; an fp32 copy of a second-moment
    stack held in another dtype) are built by :meth:`prepare` and reused while the groups, their
    parameters, ``ns_steps``, the precision and the stacks stay the same, so a step only writes
    the groups' numbers and runs the fused steps (``torch.compile(fullgraph=True)`` traces it).
    On one process the inner optimizers step the parameters themselves with their own grads;
    distributed, detached handles of the owned parameters take the reduced grads.
    """

    def __init__(self, era: dict, precision: str) -> None:
        self.era, self.precision = era, precision
        self.inner: dict[int, Any] = {}
        self.handles: list[tuple[int, int, torch.Tensor, int]] = []  # (group, index in group, handle, row)
        self.built = None  # what the inner optimizers were built for (see _structure_matches)
        self.bound: list = []  # per group: None (owns nothing) or (group's inner dict, m stack, v stack, fp32 v)
        self.bound_stale = True  # the inner state does not view the stacks yet
        self.inner_groups: dict[int, dict] = {}  # outer group index -> its inner param group

    def recipe(self) -> tuple[dict, str]:
        """What a copy needs to rebuild this object (the inner optimizers are rebuilt from the groups)."""
        return dict(self.era), self.precision

    def _owned(self, group, rank: int, world: int) -> tuple[int, int, int]:
        n = len(group["params"])
        chunk = n if world == 1 else (n + world - 1) // world
        start = rank * chunk
        return start, max(0, min(chunk, n - start)), chunk

    def state_shapes(self, group, world: int) -> dict[str, tuple[int, ...]]:
        m, n = group["params"][0].shape
        chunk = self._owned(group, 0, world)[2]
        v = (chunk, m, 1) if m >= n else (chunk, 1, n)
        return {"momentum_buffer": (chunk, m, n), "second_momentum_buffer": v}

    def ensure_state(self, state, group, world: int) -> dict:
        p = group["params"][0]
        s = state[p]
        for key, shape in self.state_shapes(group, world).items():
            if key not in s:
                s[key] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        return s

    def _structure_matches(self, groups, rank: int, world: int) -> bool:
        """The inner optimizers were built for exactly these groups and parameters (identity)."""
        built = self.built
        if built is None or built[0] != rank or built[1] != world or built[2] != self.precision \
                or len(built[3]) != len(groups):
            return False
        for (steps, params), group in zip(built[3], groups):
            if steps != int(group["ns_steps"]) or len(params) != len(group["params"]):
                return False
            for p, q in zip(params, group["params"]):
                if p is not q:
                    return False
        return True

    def _binding_matches(self, groups, state) -> bool:
        """The inner state still views the stacks the groups hold (a checkpoint load replaces them)."""
        for group, bound in zip(groups, self.bound):
            if bound is not None:
                s = state[group["params"][0]]
                if s["momentum_buffer"] is not bound[1] or s["second_momentum_buffer"] is not bound[2]:
                    return False
        return True

    def prepare(self, groups, state, rank: int, world: int, create_state: bool = True) -> None:
        """(Re)builds the inner optimizers when the groups changed and, with ``create_state``,
        creates the stacks and points the inner state at them. Cheap when nothing changed; the
        optimizers call it at construction (no state), ``init_state``, ``add_param_group`` and at
        every step (a compiled step traces the checks; see :meth:`_regroup` for changes there)."""
        if not self._structure_matches(groups, rank, world):
            self._build(groups, rank, world)
            self.bound = [None] * len(groups)
            self.bound_stale = True
        if create_state:
            for group in groups:  # every rank holds every group's stacks, owning rows or not (as nanochat)
                self.ensure_state(state, group, world)
            if self.bound_stale or not self._binding_matches(groups, state):
                self._bind(groups, state)

    def _build(self, groups, rank: int, world: int) -> None:
        """Inner param groups for the owned parameters, one inner optimizer per ``ns_steps``:
        constructed anew, or, inside a traced step, the existing optimizers regrouped."""
        handles_of: list[tuple[int, int, list[torch.Tensor]]] = []  # (group, start, handles)
        for gi, group in enumerate(groups):
            start, count, _ = self._owned(group, rank, world)
            if count:
                owned = group["params"][start : start + count]
                handles_of.append((gi, start, list(owned) if world == 1 else [p.detach() for p in owned]))
        if torch.compiler.is_compiling():
            self._regroup(groups, handles_of, rank, world)
        else:
            self._construct(groups, handles_of)
        self.handles = [(gi, start + j, h, j) for gi, start, hs in handles_of for j, h in enumerate(hs)]
        self.built = (rank, world, self.precision, [(int(g["ns_steps"]), list(g["params"])) for g in groups])

    def _construct(self, groups, handles_of) -> None:
        from ..optim import AdaptiveMuon

        self.inner, self.inner_groups = {}, {}
        by_steps: dict[int, list[int]] = {}
        for gi, _, _ in handles_of:
            by_steps.setdefault(int(groups[gi]["ns_steps"]), []).append(gi)
        handles = {gi: hs for gi, _, hs in handles_of}
        for steps, outer in by_steps.items():
            rows = NANOCHAT_POLAR_EXPRESS[: max(1, min(steps, len(NANOCHAT_POLAR_EXPRESS)))]
            self.inner[steps] = AdaptiveMuon(
                [{"params": handles[gi]} for gi in outer], **_IDLE_INNER_VALUES, nesterov=True,
                weight_decay_method="cautious", fp32_matmul_prec=self.precision, coefficient_type="custom",
                custom_coefficient_sets=rows, num_ns_steps=len(rows), scale_mode="shape_scaling",
                moment2_method="normuon", eps=VARIANCE_FLOOR, ns_eps_mode="add", ns_eps=NS_EPS,
                **self.era,
            )
            for gi, g in zip(outer, self.inner[steps].param_groups):
                # torch.compile marks the groups of an optimizer stepped inside a traced region
                # capturable (the fused step does not read it): set up front, the first compiled step
                # changes nothing the next one is guarded on
                g["capturable"] = True
                self.inner_groups[gi] = g

    def _regroup(self, groups, handles_of, rank: int, world: int) -> None:
        """Inside a traced step (no optimizer can be constructed there): the existing inner
        optimizers take the new groups, as a fused optimizer takes params swapped in its groups.
        A new ``ns_steps`` value, another precision or a distributed run needs an eager rebuild."""
        steps_of = {gi: int(groups[gi]["ns_steps"]) for gi, _, _ in handles_of}
        built = self.built
        if world > 1 or built is None or built[0] != rank or built[1] != world or built[2] != self.precision \
                or any(steps not in self.inner for steps in steps_of.values()):
            raise RuntimeError(
                "the Muon param groups changed (a new ns_steps value, the precision or the distributed "
                "layout) inside a compiled step: call the optimizer's init_state() once outside torch.compile "
                "after changing them")
        self.inner_groups = {}
        for steps, opt in self.inner.items():
            regrouped = []
            for gi, _, hs in handles_of:
                if steps_of[gi] == steps:
                    g = dict(opt.defaults)
                    g.update(_IDLE_INNER_VALUES, capturable=True, params=hs)
                    regrouped.append(g)
                    self.inner_groups[gi] = g
            opt.param_groups[:] = regrouped

    def _bind(self, groups, state) -> None:
        for opt in self.inner.values():
            opt.state.clear()
        self.bound = [None] * len(groups)
        rows: dict[int, list] = {}
        for gi, _, handle, row in self.handles:
            rows.setdefault(gi, []).append((handle, row))
        for gi, members in rows.items():
            group = groups[gi]
            s = state[group["params"][0]]
            m, v = s["momentum_buffer"], s["second_momentum_buffer"]
            # the fused statistics are fp32: another dtype's stack is stepped through an fp32 copy
            v32 = v if v.dtype == torch.float32 else torch.empty(v[: len(members)].shape, dtype=torch.float32,
                                                                 device=v.device)
            target = self.inner[int(group["ns_steps"])]
            for handle, row in members:
                target.state[handle] = {"momentum_buffer": m[row], "moment2_buffer": v32[row]}
            self.bound[gi] = (self.inner_groups[gi], m, v, None if v32 is v else v32)
        self.bound_stale = False

    def step(self, groups, state, rank: int, world: int, grads_of=None) -> None:
        """One step of the owned parameters; distributed, ``grads_of(gi)`` gives group gi's owned
        grads, stacked (on one process the parameters' own grads are stepped)."""
        self.prepare(groups, state, rank, world)
        if not self.inner:
            return
        lowp = []
        for group, bound in zip(groups, self.bound):
            if bound is None:
                continue
            g, _, v, v32 = bound
            m, n = group["params"][0].shape
            beta2 = group["beta2"]
            # nanochat decays by lr·scale·wd; the fused update scales lr alone by the scale
            g.update(lr=group["lr"], momentum=group["momentum"],
                     weight_decay=group["weight_decay"] * math.sqrt(max(1.0, m / n)),
                     beta2=0.0 if beta2 is None else beta2)
            if v32 is not None:
                v32.copy_(v[: v32.shape[0]])
                lowp.append((v, v32))
        try:
            if world > 1:
                stacked_grads = {}
                for gi, _, handle, row in self.handles:
                    if gi not in stacked_grads:
                        stacked_grads[gi] = grads_of(gi)
                    handle.grad = stacked_grads[gi][row]
            for opt in self.inner.values():
                opt.step()
        finally:
            if world > 1:
                for _, _, handle, _ in self.handles:
                    handle.grad = None
            # between steps the inner groups hold fixed numbers: a compiled step is guarded on the
            # outer groups' values alone (no recompilation for the inner copies of a schedule)
            for bound in self.bound:
                if bound is not None:
                    bound[0].update(_IDLE_INNER_VALUES)
        for v, v32 in lowp:
            v[: v32.shape[0]].copy_(v32)


def _reduce_scatter_mean(chunks_out: torch.Tensor, stacked: torch.Tensor, world: int):
    """Async reduce-scatter of a (world * chunk, ...) stack; the sum is divided by ``world`` on wait."""
    return collectives.reduce_scatter(chunks_out, list(stacked.chunk(world)), op=dist.ReduceOp.SUM, async_op=True)


class _RecipeState:
    """Pickling and checked loading of an optimizer that holds a :class:`_StackedMuon`.

    ``load_state_dict`` refuses a state tensor that cannot serve its parameter (the optimizer's
    ``_expected_state``) before anything changes. torch.optim.Optimizer pickles defaults, state and param_groups only: the Muon recipe goes along
    (copy.deepcopy, pickle) and the inner optimizers are rebuilt on the other side, from the
    recipe or, without one, from ``_default_recipe()``; ``_restored()`` then rebuilds the rest.
    """

    _muon: _StackedMuon

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state["_muon_recipe"] = self._muon.recipe()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        recipe = state.pop("_muon_recipe", None)
        super().__setstate__(state)  # type: ignore[misc]
        if recipe is None and "_muon" in self.__dict__:
            return  # torch's load_state_dict passes its state and groups through here: keep the recipe
        default = self._default_recipe()
        era, precision = recipe if recipe is not None else default
        self._muon = _StackedMuon(dict(era), precision)
        self._restored()

    def _default_recipe(self) -> tuple[Any, str]:
        """The recipe of a copy saved without one: 22a71aa's, iterating in bf16."""
        return ERA_2201, "medium"

    def _restored(self) -> None:
        """Rebuilds what depends on the recipe once ``_muon`` is set (each optimizer its own)."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_loaded_state(self, state_dict)  # type: ignore[arg-type]
        super().load_state_dict(state_dict)  # type: ignore[misc]


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


def _muon_distributed_step(muon: _StackedMuon, groups, state, rank: int, world: int) -> None:
    """nanochat's chunked exchange: reduce-scatter the padded stacked grads (mean), the owners step
    their contiguous chunk, all-gather the chunks back into every rank's parameters."""
    pending = []
    for group in groups:
        params = group["params"]
        chunk = (len(params) + world - 1) // world
        stacked = torch.zeros((chunk * world, *params[0].shape), dtype=params[0].dtype, device=params[0].device)
        torch.stack([p.grad for p in params], out=stacked[: len(params)])
        out = torch.empty((chunk, *params[0].shape), dtype=stacked.dtype, device=stacked.device)
        pending.append((out, _reduce_scatter_mean(out, stacked, world), stacked))
    for out, work, _ in pending:
        work.wait()
        out.div_(world)
    muon.step(groups, state, rank, world, lambda gi: pending[gi][0])
    gathers = []
    for gi, group in enumerate(groups):
        params = group["params"]
        chunk = (len(params) + world - 1) // world
        start, count = rank * chunk, max(0, min(chunk, len(params) - rank * chunk))
        mine = torch.zeros((chunk, *params[0].shape), dtype=params[0].dtype, device=params[0].device)
        if count:
            torch.stack([params[start + j].detach() for j in range(count)], out=mine[:count])
        stacked = pending[gi][2]  # the grads' buffer takes the gathered params (as nanochat)
        gathers.append((group, stacked, collectives.all_gather(list(stacked.chunk(world)), mine, async_op=True)))
    for group, stacked, work in gathers:
        work.wait()
        params = group["params"]
        torch._foreach_copy_([p.detach() for p in params], list(stacked[: len(params)].unbind(0)))


class Muon(_NanochatMuonBase):
    """nanochat's ``Muon`` at 22a71aa: ``Muon(params, lr=0.02, momentum=0.95, ns_steps=5,
    beta2=0.95, weight_decay=0.0)`` for 2-D parameters (see the module docstring)."""


class DistMuon(_NanochatMuonBase):
    """nanochat's ``DistMuon`` at 22a71aa: every rank holds all parameters and its own grads; per
    shape group the stacked grads are reduce-scattered (mean), rank r steps its contiguous chunk of
    ``chunk_size = ceil(len / world_size)`` parameters and keeps their state, and an all-gather
    shares the new values. Each rank's ``state_dict()`` loads into nanochat's DistMuon on the
    same rank of the same world size, and back."""

    _distributed = True


class MuonAdamW(_RecipeState, StepStatsReporter, torch.optim.Optimizer):
    """nanochat's ``MuonAdamW`` (``nanochat/optim.py`` as of a9d0a86): ``MuonAdamW(param_groups)``
    with groups of ``kind='adamw'`` (``lr``, ``betas``, ``eps``, ``weight_decay``) and
    ``kind='muon'`` (``lr``, ``momentum``, ``ns_steps``, ``beta2``, ``weight_decay``; one shape per
    group, as nanochat's ``setup_optimizer`` builds them).

    Muon groups: the module docstring's step with today's recipe, computing in
    :func:`compute_dtype`. AdamW groups: decoupled decay ``p *= 1 - lr·wd``, then Adam with bias
    correction, in fp32 whatever the parameter's dtype (torch's AdamW kernels: fused on CUDA,
    foreach otherwise); state ``step`` (an int), ``exp_avg``, ``exp_avg_sq``.

    With a multi-rank process group initialized, gradients are averaged here (no DDP) and the
    state is sharded as nanochat shards it (ZeRO-2): Muon groups as :class:`DistMuon`; AdamW params
    of fewer than 1024 elements are all-reduced and stepped whole on every rank, larger ones are
    reduce-scattered along dim 0 (which the world size must divide), each rank steps and keeps the
    state of its row slice, and an all-gather shares the result.
    """

    def __init__(self, param_groups: list[dict]) -> None:
        groups = [dict(g) for g in param_groups]
        for gi, g in enumerate(groups):
            kind = g.get("kind")
            if kind not in ("adamw", "muon"):
                raise ValueError(f"param_groups[{gi}]['kind'] must be 'adamw' or 'muon', got {kind!r}")
            g["params"] = list(g["params"])
            needed = ("lr", "betas", "eps", "weight_decay") if kind == "adamw" else \
                ("lr", "momentum", "ns_steps", "beta2", "weight_decay")
            missing = [k for k in needed if k not in g]
            if missing:
                raise ValueError(f"param_groups[{gi}] (kind {kind!r}) lacks {missing}: nanochat's MuonAdamW takes "
                                 "every value in the group")
            _check_values(g, f"param_groups[{gi}]")
            if kind == "muon":
                shapes = {tuple(p.shape) for p in g["params"]}
                if len(shapes) != 1 or any(p.ndim != 2 for p in g["params"]):
                    raise ValueError(f"param_groups[{gi}] (kind 'muon') must hold 2-D params of one shape, got "
                                     f"{sorted(shapes)}")
        dtype = compute_dtype()
        self.compute_dtype = dtype
        self._muon = _StackedMuon(ERA_TODAY, _precision(dtype))
        self._adam_steps: dict[torch.Tensor, torch.Tensor] = {}  # the step count handed to torch's AdamW
        self._adam_lr_buffers: dict[tuple[int, torch.device], torch.Tensor] = {}  # compiled: each group's lr
        super().__init__(groups, defaults={})
        self._muon.prepare(self._muon_groups(), self.state, *_world(), create_state=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_muon"):  # after construction: the inner optimizers follow the groups
            self._muon.prepare(self._muon_groups(), self.state, *_world(), create_state=False)

    def __getstate__(self) -> dict[str, Any]:
        # the compute dtype goes along too; the step / lr tensors handed to torch's AdamW (rewritten
        # every step) are rebuilt on the other side
        state = super().__getstate__()
        state["compute_dtype"] = self.compute_dtype
        return state

    def _default_recipe(self) -> tuple[Any, str]:
        if "compute_dtype" not in self.__dict__:
            self.compute_dtype = compute_dtype()
        return ERA_TODAY, _precision(self.compute_dtype)

    def _restored(self) -> None:
        self._adam_steps = {}
        self._adam_lr_buffers = {}
        self._muon.prepare(self._muon_groups(), self.state, *_world(), create_state=False)

    def _muon_groups(self):
        return [g for g in self.param_groups if g["kind"] == "muon"]

    def _expected_state(self, p, key):
        rank, world = _world()
        for group in self.param_groups:
            if group["kind"] == "muon" and group["params"][0] is p:
                shape = self._muon.state_shapes(group, world).get(key)
                return None if shape is None else (shape, p.dtype)
            if group["kind"] == "adamw" and any(q is p for q in group["params"]) and key in ("exp_avg", "exp_avg_sq"):
                return tuple(self._adamw_slice(p, rank, world).shape), p.dtype
        return None

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates the whole state up front (zeros, AdamW ``step`` 0), as the first step would."""
        rank, world = _world()
        self._muon.prepare(self._muon_groups(), self.state, rank, world)
        for group in self.param_groups:
            if group["kind"] == "muon":
                continue
            for p in group["params"]:
                if not self.state[p]:
                    piece = self._adamw_slice(p, rank, world)
                    self.state[p].update(step=0, exp_avg=torch.zeros_like(piece), exp_avg_sq=torch.zeros_like(piece))

    @staticmethod
    def _adamw_slice(p: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        if world == 1 or p.numel() < SMALL_ADAMW_NUMEL:
            return p.detach()
        rows = p.shape[0] // world
        return p.detach()[rank * rows : (rank + 1) * rows]

    @torch.no_grad()
    @records_step_stats
    def step(self):
        rank, world = _world()
        for gi, group in enumerate(self.param_groups):
            if group["kind"] not in ("adamw", "muon"):
                raise ValueError(f"Unknown optimizer kind: {group['kind']}")
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    raise RuntimeError(f"MuonAdamW needs a grad for every parameter (as nanochat's): "
                                       f"param_groups[{gi}]['params'][{pi}] has none")
                if group["kind"] == "adamw" and world > 1 and p.numel() >= SMALL_ADAMW_NUMEL \
                        and p.shape[0] % world:
                    raise ValueError(f"AdamW reduce_scatter requires shape[0] ({p.shape[0]}) divisible by "
                                     f"world_size ({world}): param_groups[{gi}]['params'][{pi}]")
        adamw_lrs = {}
        if torch.compiler.is_compiling():
            for gi, group in enumerate(self.param_groups):
                if group["kind"] == "adamw" and group["params"]:
                    adamw_lrs[gi] = self._adam_lr(gi, group["params"][0].device, group["lr"])
        adamw_grads = self._reduce_adamw(world)
        muon_groups = self._muon_groups()
        if muon_groups:
            if world == 1:
                self._muon.step(muon_groups, self.state, rank, world)
            else:
                _muon_distributed_step(self._muon, muon_groups, self.state, rank, world)
        self._adamw_step(adamw_grads, rank, world, adamw_lrs)

    def _reduce_adamw(self, world: int):
        """Every AdamW param's (averaged) grad for this rank's slice; waits for the collectives."""
        out, works = {}, []
        for group in self.param_groups:
            if group["kind"] != "adamw":
                continue
            for p in group["params"]:
                if world == 1:
                    out[p] = p.grad
                elif p.numel() < SMALL_ADAMW_NUMEL:
                    g = p.grad.clone()
                    works.append((g, collectives.all_reduce(g, op=dist.ReduceOp.SUM, async_op=True)))
                    out[p] = g
                else:
                    g = torch.empty_like(p.grad[: p.shape[0] // world])
                    works.append((g, collectives.reduce_scatter(g, list(p.grad.chunk(world)), op=dist.ReduceOp.SUM,
                                                         async_op=True)))
                    out[p] = g
        for g, work in works:
            work.wait()
            g.div_(world)
        return out

    def _adamw_step(self, grads, rank: int, world: int, lrs) -> None:
        gathers = []
        for gi, group in enumerate(self.param_groups):
            if group["kind"] != "adamw" or not group["params"]:
                continue
            slices, gs, m1, m2, steps, owners = [], [], [], [], [], []
            for p in group["params"]:
                s = self.state[p]
                piece = self._adamw_slice(p, rank, world)
                if not s:
                    s.update(step=0, exp_avg=torch.zeros_like(piece), exp_avg_sq=torch.zeros_like(piece))
                slices.append(piece)
                gs.append(grads[p])
                m1.append(s["exp_avg"])
                m2.append(s["exp_avg_sq"])
                steps.append(self._adam_step(p, piece.device, s["step"]))
                owners.append(p)
            _adamw_fp32(slices, gs, m1, m2, steps, group, lrs.get(gi, group["lr"]))
            for p in owners:
                self.state[p]["step"] += 1  # as torch's AdamW advanced its step tensor
                if world > 1 and p.numel() >= SMALL_ADAMW_NUMEL:
                    piece = self._adamw_slice(p, rank, world).clone()
                    gathers.append(collectives.all_gather(list(p.detach().chunk(world)), piece, async_op=True))
        for work in gathers:
            work.wait()

    def _adam_step(self, p: torch.Tensor, device: torch.device, step: int) -> torch.Tensor:
        """The 0-dim fp32 step tensor torch's AdamW reads and advances, holding ``step`` (kept per
        parameter: a step allocates nothing on the host, and under torch.compile it is traced)."""
        t = self._adam_steps.get(p)
        if t is None or t.device != device:
            t = torch.zeros((), dtype=torch.float32, device=device)
            self._adam_steps[p] = t
        t.fill_(step)
        return t

    def _adam_lr(self, gi: int, device: torch.device, value) -> torch.Tensor:
        """Compiled: group gi's lr as a tensor, so that a schedule writing a new float every step is
        a graph input (torch's AdamW would make a float lr a constant of the graph). The buffer
        has one dimension: torch.compile treats a 0-dim fp64 CPU tensor as a number of its own."""
        buf = self._adam_lr_buffers.get((gi, device))
        if buf is None:
            buf = self._adam_lr_buffers[(gi, device)] = torch.zeros(1, dtype=torch.float64, device=device)
        if isinstance(value, torch.Tensor):
            buf.copy_(value.reshape(1))
        else:
            buf.zero_().add_(value)  # keeps the float a graph input (fill_ would specialize on it)
        return buf


def _adamw_fp32(params, grads, exp_avgs, exp_avg_sqs, steps, group, lr) -> None:
    """torch's AdamW (decoupled decay) over one group, the math in fp32 for every dtype."""
    beta1, beta2 = group["betas"]
    on_cuda = all(p.is_cuda for p in params)
    lowp = [i for i, p in enumerate(params) if p.dtype != torch.float32]
    work = [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs)]
    for i in lowp:  # bf16 embeddings: fp32 copies in, results cast back (nanochat's fp32 math)
        for lst in work:
            lst[i] = lst[i].float()
    adam_functional(
        work[0], work[1], work[2], work[3], [], steps,
        amsgrad=False, has_complex=False, beta1=beta1, beta2=beta2, lr=lr,
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        # compiled: torch's capturable formulation (bias corrections as tensor math) is the one it
        # traces (otherwise a CUDA step tensor leaves the graph and the foreach step fails on a CPU)
        foreach=None if on_cuda else True, capturable=torch.compiler.is_compiling(), differentiable=False,
        fused=True if on_cuda else None, decoupled_weight_decay=True,
    )
    for i in lowp:
        params[i].copy_(work[0][i])
        exp_avgs[i].copy_(work[2][i])
        exp_avg_sqs[i].copy_(work[3][i])
