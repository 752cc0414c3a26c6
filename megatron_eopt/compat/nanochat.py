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
"""

from __future__ import annotations

import math
import os
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.optim.adam import adam as adam_functional

from ..optim._config import check_group_hyperparameters
from ..optim._state_check import check_loaded_state

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


class _StackedMuon:
    """The Muon side: nanochat's stacked per-group state stepped by fused AdaptiveMuon optimizers
    (one per distinct ``ns_steps``) over the owned parameters.

    ``groups`` are the (outer) param-group dicts, each of one shape; a rank owns, in group g,
    the parameters ``[start, start + count)`` with a state stack of ``chunk`` rows.
    """

    def __init__(self, era: dict, precision: str) -> None:
        self.era, self.precision = era, precision
        self.inner: dict[int, Any] = {}
        self.signature = None

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

    def _build(self, groups, rank: int, world: int) -> None:
        from ..optim import AdaptiveMuon

        self.inner = {}
        self.handles = []  # (outer group index, index in group, handle, row of the stack)
        by_steps: dict[int, list[dict]] = {}
        for gi, group in enumerate(groups):
            start, count, _ = self._owned(group, rank, world)
            if count == 0:
                continue
            handles = [group["params"][start + j].detach() for j in range(count)]
            by_steps.setdefault(int(group["ns_steps"]), []).append({"params": handles})
            self.handles += [(gi, start + j, h, j) for j, h in enumerate(handles)]
        for steps, inner_groups in by_steps.items():
            rows = NANOCHAT_POLAR_EXPRESS[: max(1, min(steps, len(NANOCHAT_POLAR_EXPRESS)))]
            self.inner[steps] = AdaptiveMuon(
                inner_groups, lr=0.0, momentum=0.0, weight_decay=0.0, nesterov=True,
                weight_decay_method="cautious", fp32_matmul_prec=self.precision, coefficient_type="custom",
                custom_coefficient_sets=rows, num_ns_steps=len(rows), scale_mode="shape_scaling",
                moment2_method="normuon", beta2=0.0, eps=VARIANCE_FLOOR, ns_eps_mode="add", ns_eps=NS_EPS,
                **self.era,
            )
        self.signature = self._signature(groups, rank, world)

    @staticmethod
    def _signature(groups, rank, world):
        return (rank, world, tuple((int(g["ns_steps"]), tuple(id(p) for p in g["params"])) for g in groups))

    def step(self, groups, state, grads_of, rank: int, world: int) -> None:
        """One step of the owned parameters; ``grads_of(gi)`` gives group gi's owned grads, stacked."""
        if self.signature != self._signature(groups, rank, world):
            self._build(groups, rank, world)
        for group in groups:  # every rank holds every group's stacks, owning rows or not (as nanochat)
            self.ensure_state(state, group, world)
        if not self.inner:
            return
        # hyper-parameters, and the inner state as views of the stacks
        inner_group = {}
        for steps, opt in self.inner.items():
            for g in opt.param_groups:
                inner_group[id(g["params"][0])] = g
        copies = []
        stacked_grads = {}
        for gi, index, handle, row in self.handles:
            group = groups[gi]
            s = self.ensure_state(state, group, world)
            if gi not in stacked_grads:
                stacked_grads[gi] = grads_of(gi)
            m, n = handle.shape
            scale = math.sqrt(max(1.0, m / n))
            target = self._inner_for(group)
            g = inner_group.get(id(handle))
            if g is not None:
                beta2 = group["beta2"]
                # nanochat decays by lr·scale·wd; the fused update scales lr alone by the scale
                g.update(lr=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"] * scale,
                         beta2=0.0 if beta2 is None else beta2)
            v = s["second_momentum_buffer"][row]
            if v.dtype != torch.float32:  # the fused statistics are fp32: a copy, written back below
                copies.append((v, v.float()))
                v = copies[-1][1]
            target.state[handle] = {"momentum_buffer": s["momentum_buffer"][row], "moment2_buffer": v}
            handle.grad = stacked_grads[gi][row]
        try:
            for opt in self.inner.values():
                opt.step()
        finally:
            for _, _, handle, _ in self.handles:
                handle.grad = None
        for stored, fp32 in copies:
            stored.copy_(fp32)

    def _inner_for(self, group):
        return self.inner[int(group["ns_steps"])]


def _reduce_scatter_mean(chunks_out: torch.Tensor, stacked: torch.Tensor, world: int):
    """Async reduce-scatter of a (world * chunk, ...) stack; the sum is divided by ``world`` on wait."""
    return dist.reduce_scatter(chunks_out, list(stacked.chunk(world)), op=dist.ReduceOp.SUM, async_op=True)


class _NanochatMuonBase(torch.optim.Optimizer):
    """Muon / DistMuon of 22a71aa: groups by sorted shape, stacked state on each group's first param."""

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
        super().__init__(param_groups, defaults)
        self._muon = _StackedMuon(ERA_2201, "medium")  # 22a71aa iterates in bf16 on every device

    def _world(self) -> tuple[int, int]:
        return _world() if self._distributed else (0, 1)

    def _expected_state(self, p, key):
        _, world = self._world()
        for group in self.param_groups:
            if group["params"][0] is p:
                shape = self._muon.state_shapes(group, world).get(key)
                return None if shape is None else (shape, p.dtype)
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_loaded_state(self, state_dict)
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates every group's stacks (zeros) up front, as the first step would (checkpoint loading)."""
        _, world = self._world()
        for group in self.param_groups:
            self._muon.ensure_state(self.state, group, world)

    @torch.no_grad()
    def step(self):
        rank, world = self._world()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    raise RuntimeError(f"{type(self).__name__} needs a grad for every parameter (as nanochat's): "
                                       f"param_groups[{gi}]['params'][{pi}] has none")
        if world == 1:
            self._muon.step(self.param_groups, self.state,
                            lambda gi: torch.stack([p.grad for p in self.param_groups[gi]["params"]]), rank, world)
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
    muon.step(groups, state, lambda gi: pending[gi][0], rank, world)
    gathers = []
    for gi, group in enumerate(groups):
        params = group["params"]
        chunk = (len(params) + world - 1) // world
        start, count = rank * chunk, max(0, min(chunk, len(params) - rank * chunk))
        mine = torch.zeros((chunk, *params[0].shape), dtype=params[0].dtype, device=params[0].device)
        if count:
            torch.stack([params[start + j].detach() for j in range(count)], out=mine[:count])
        stacked = pending[gi][2]  # the grads' buffer takes the gathered params (as nanochat)
        gathers.append((group, stacked, dist.all_gather(list(stacked.chunk(world)), mine, async_op=True)))
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


class MuonAdamW(torch.optim.Optimizer):
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
        super().__init__(groups, defaults={})
        dtype = compute_dtype()
        self.compute_dtype = dtype
        self._muon = _StackedMuon(ERA_TODAY, _precision(dtype))

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

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_loaded_state(self, state_dict)
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def init_state(self) -> None:
        """Creates the whole state up front (zeros, AdamW ``step`` 0), as the first step would."""
        rank, world = _world()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon.ensure_state(self.state, group, world)
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
        adamw_grads = self._reduce_adamw(world)
        muon_groups = self._muon_groups()
        if muon_groups:
            if world == 1:
                self._muon.step(muon_groups, self.state,
                                lambda gi: torch.stack([p.grad for p in muon_groups[gi]["params"]]), rank, world)
            else:
                _muon_distributed_step(self._muon, muon_groups, self.state, rank, world)
        self._adamw_step(adamw_grads, rank, world)

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
                    works.append((g, dist.all_reduce(g, op=dist.ReduceOp.SUM, async_op=True)))
                    out[p] = g
                else:
                    g = torch.empty_like(p.grad[: p.shape[0] // world])
                    works.append((g, dist.reduce_scatter(g, list(p.grad.chunk(world)), op=dist.ReduceOp.SUM,
                                                         async_op=True)))
                    out[p] = g
        for g, work in works:
            work.wait()
            g.div_(world)
        return out

    def _adamw_step(self, grads, rank: int, world: int) -> None:
        gathers = []
        for group in self.param_groups:
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
                steps.append(torch.tensor(float(s["step"]), device=piece.device))
                owners.append(p)
            _adamw_fp32(slices, gs, m1, m2, steps, group)
            for p, t in zip(owners, steps):
                self.state[p]["step"] = int(t.item())
                if world > 1 and p.numel() >= SMALL_ADAMW_NUMEL:
                    piece = self._adamw_slice(p, rank, world).clone()
                    gathers.append(dist.all_gather(list(p.detach().chunk(world)), piece, async_op=True))
        for work in gathers:
            work.wait()


def _adamw_fp32(params, grads, exp_avgs, exp_avg_sqs, steps, group) -> None:
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
        amsgrad=False, has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        foreach=None if on_cuda else True, capturable=False, differentiable=False,
        fused=True if on_cuda else None, decoupled_weight_decay=True,
    )
    for i in lowp:
        params[i].copy_(work[0][i])
        exp_avgs[i].copy_(work[2][i])
        exp_avg_sqs[i].copy_(work[3][i])
