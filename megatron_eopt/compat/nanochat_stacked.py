"""The Muon step nanochat's optimizers since January 2026 share: stacked per-shape state on the fused ops.

nanochat's Muon groups hold one shape each and their state sits on the group's first parameter,
stacked, ``momentum_buffer`` (k, m, n) and ``second_momentum_buffer`` (k, m, 1) for m ≥ n else
(k, 1, n), in the parameters' dtype, where k is the group's size on one process or, distributed,
the rank's chunk ``ceil(len / world_size)`` (rank r owns the r-th contiguous chunk). The fused
:class:`megatron_eopt.optim.AdaptiveMuon` works on views of those stacks (:class:`_StackedMuon`),
so checkpoints load in both directions with nanochat's own classes.

The step of a Muon group (the recipe of the era: ``ERA_2201`` for ``nanochat/muon.py`` at 22a71aa,
``ERA_TODAY`` adds what the later commits added): Nesterov momentum ``M ← lerp(M, g, 1-momentum)``,
``G = lerp(g, M, momentum)``; today: MuonEq row equilibration; Polar Express (nanochat's five rows,
the first ``ns_steps``) after dividing by ``s·‖X‖ + 1e-6`` (s = 1.02 at 22a71aa, 1.01 today), in
bf16 at 22a71aa and today in the compute dtype (``nanochat_muon_adamw.compute_dtype``); today:
Muon+ renormalization to √min(m, n); variance reduction (NorMuon with a 1e-10 floor:
``AdaptiveMuon(moment2_method="normuon", eps=1e-10)``; ``beta2=None`` is 0); cautious weight decay
and the update with ``lr·√max(1, m/n)`` for both.

Distributed, :func:`_muon_distributed_step` is nanochat's chunked exchange (reduce-scatter of the
stacked grads, each rank steps its chunk, all-gather). :class:`_RecipeState` pickles the recipe
and checks a loaded state. The single-process steps run under ``torch.compile(fullgraph=True)``:
the fused optimizers and their state views are built outside the step (see :class:`_StackedMuon`).
The optimizers on top: ``nanochat_muon`` (Muon, DistMuon) and ``nanochat_muon_adamw`` (MuonAdamW).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from .. import _collectives as collectives
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

# The two eras' Muon recipes as options of the fused AdaptiveMuon (see the module docstring).
ERA_2201 = dict(ns_norm_divisor=1.02)
ERA_TODAY = dict(ns_norm_divisor=1.01, row_equilibration=True, frobenius_renorm=True)


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
