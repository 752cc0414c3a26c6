"""nanochat's ``MuonAdamW`` (``nanochat/optim.py`` as of a9d0a86, July 2026) on the fused step and torch's AdamW.

MuonEq, Polar Express, Muon+, variance reduction and cautious weight decay for the Muon groups
(``nanochat_stacked.ERA_TODAY``), computing in :func:`compute_dtype` (nanochat's
``COMPUTE_DTYPE``); AdamW in fp32 for the rest; ZeRO-2 style sharding when a multi-rank process
group is initialized. A compiled AdamW step takes its lr and step count as tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.adam import adam as adam_functional

from .. import _collectives as collectives
from ..step_stats import StepStatsReporter, records_step_stats
from .nanochat_stacked import ERA_TODAY, _check_values, _muon_distributed_step, _RecipeState, _StackedMuon, _world

SMALL_ADAMW_NUMEL = 1024  # distributed AdamW: smaller params are all-reduced, not sharded

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


class MuonAdamW(_RecipeState, StepStatsReporter, torch.optim.Optimizer):
    """nanochat's ``MuonAdamW`` (``nanochat/optim.py`` as of a9d0a86): ``MuonAdamW(param_groups)``
    with groups of ``kind='adamw'`` (``lr``, ``betas``, ``eps``, ``weight_decay``) and
    ``kind='muon'`` (``lr``, ``momentum``, ``ns_steps``, ``beta2``, ``weight_decay``; one shape per
    group, as nanochat's ``setup_optimizer`` builds them).

    Muon groups: ``nanochat_stacked``'s step with today's recipe, computing in
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
