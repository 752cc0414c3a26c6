"""Keller Jordan's Muon snippet and nanochat's ``muon.py`` up to January 2026 (served by
``megatron_eopt.muon``): :func:`zeropower_via_newtonschulz5`, :class:`Muon` and :class:`DistMuon`
on the fused :class:`megatron_eopt.optim.Muon`."""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from ..optim._closure import closure_loss
from ..optim.step.state_check import check_loaded_state
from ..step_stats import StepStatsReporter, records_step_stats
from . import motif
from ._deprecation import _warn_once

# How DistMuon picks the rank that steps a matrix and keeps its momentum.
OWNER_RULES = ("nanochat", "balanced")

# The snippets' Muon (Keller Jordan, nanochat) on the fused optimizer: decoupled decay, the original
# quintic in bf16 after dividing by ||X|| + 1e-7, update scaled by sqrt(max(1, m / n)).
SNIPPET_MUON = dict(weight_decay_method="decoupled", fp32_matmul_prec="medium", coefficient_type="simple",
                    scale_mode="shape_scaling", ns_eps_mode="add")
SNIPPET_EPS = 1e-7

# Keller Jordan's quintic: fast to reach singular values in about [0.7, 1.2], not exactly 1.
_SIMPLE = "simple"


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximately orthogonalizes G (``..., m, n``; batched over leading dims) in bf16.

    The popular snippet's semantics: ``steps`` iterations of the simple quintic after dividing
    by ``‖G‖_F + 1e-7``, bf16 products accumulated in fp32, matrices with more rows than columns
    iterated transposed; the result is bf16 with G's shape.
    """
    _warn_once("zeropower_via_newtonschulz5")
    return _zeropower_bf16(G, steps)


def _zeropower_bf16(G: torch.Tensor, steps: int) -> torch.Tensor:
    from ..ops import newton_schulz

    if not isinstance(G, torch.Tensor):
        raise TypeError(f"G must be a torch.Tensor, got {type(G).__name__}")
    if G.ndim < 2:
        raise ValueError(f"G must have at least 2 dimensions (..., m, n), got shape {tuple(G.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    x = G.detach().float()
    if x.ndim > 3:
        x = x.reshape(-1, *x.shape[-2:])
    # divided by ||X|| + eps, inside the op
    out = newton_schulz(x.contiguous(), steps=steps, coefficient_type=_SIMPLE, eps=SNIPPET_EPS, precision="medium",
                        eps_mode="add")
    return out.reshape(G.shape).to(torch.bfloat16)


def _resolve_steps(ns_steps: int, backend: str, backend_steps: int | None) -> int:
    if backend != "newtonschulz5":
        raise ValueError(f"backend must be 'newtonschulz5' (the only one the snippets define), got {backend!r}")
    if backend_steps is not None:
        if ns_steps != 5 and ns_steps != backend_steps:
            raise ValueError(f"ns_steps={ns_steps} and backend_steps={backend_steps} disagree; give one of them")
        ns_steps = backend_steps
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive int, got {ns_steps!r}")
    return ns_steps


def _legacy_scale(shape: torch.Size) -> float:
    # The snippets scale by the parameter's own last two dims (a conv kernel's kh/kw).
    return math.sqrt(max(1.0, shape[-2] / shape[-1]))


# The defaults that lr=None / weight_decay=None stand for on each path of the name Muon.
SNIPPET_DEFAULTS = {"lr": 0.02, "weight_decay": 0.0}
# Keywords only the snippet's Muon takes (Motif's has no Newton–Schulz backend choice).
_SNIPPET_ONLY_KEYS = ("backend", "backend_steps")


def _check_snippet_state_dtype(state_dtype: str) -> None:
    from ..low_memory_state import validate_state_dtype

    validate_state_dtype(state_dtype)
    if state_dtype != "fp32":
        raise ValueError(
            f"state_dtype={state_dtype!r}: megatron_eopt.muon.Muon given a flat parameter list is the snippet's "
            "Muon, which keeps nanochat's fp32 momentum_buffer (its checkpoint layout). Low-memory state is "
            "offered with Motif's param groups flagged use_muon, or by megatron_eopt.optim.Muon(params, lr=0.02, "
            "weight_decay=0.0, nesterov=True, coefficient_type='simple', scale_mode='shape_scaling', "
            f"state_dtype={state_dtype!r})"
        )


def _check_motif_call(params: list, kwargs: dict[str, Any]) -> None:
    """Refuses, naming them, the arguments of one library given to the other's Muon."""
    snippet_only = [k for k in _SNIPPET_ONLY_KEYS if k in kwargs]
    if snippet_only:
        raise TypeError(
            f"megatron_eopt.muon.Muon: {_arguments(snippet_only)} of the snippet's Muon (built from a flat parameter "
            "list); param groups flagged use_muon and Motif's keywords build Motif's Muon, which has no such argument"
        )
    if params and not any(isinstance(g, Mapping) for g in params):
        motif_keys = [k for k in motif.MOTIF_KEYS if k in kwargs]
        raise TypeError(
            f"megatron_eopt.muon.Muon: {_arguments(motif_keys)} of Motif's Muon, which takes param groups flagged "
            "use_muon (e.g. get_default_muon_param_groups(model)); a flat parameter list builds the snippet's Muon, "
            "which has no such argument"
        )


def _arguments(names: list[str]) -> str:
    quoted = ", ".join(repr(n) for n in names)
    return f"{quoted} is an argument" if len(names) == 1 else f"{quoted} are arguments"


class _DispatchSignature:
    """What ``inspect.signature(Muon)`` shows: the parameters of both optimizers the name builds
    (a subclass such as DistMuon shows its own constructor's)."""

    def __init__(self) -> None:
        P = inspect.Parameter
        kw = P.KEYWORD_ONLY
        keywords = dict(
            momentum=0.95, nesterov=True, ns_steps=5, weight_decay=None,
            backend="newtonschulz5", backend_steps=None, state_dtype="fp32",
            adamw_betas=(0.9, 0.95), adamw_eps=1e-8, none_grad=True, clip_config=None, expert_keys=None,
            cpu_offload=False, debug=False, warmup_step=5, chunk_size=-1, use_distributed_muon=False,
        )
        self.signature = inspect.Signature(
            [P("params", P.POSITIONAL_OR_KEYWORD), P("lr", P.POSITIONAL_OR_KEYWORD, default=None),
             P("args", P.VAR_POSITIONAL)]
            + [P(name, kw, default=value) for name, value in keywords.items()]
        )

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner = owner

    def __get__(self, obj: Any, objtype: type | None = None) -> inspect.Signature | None:
        return self.signature if obj is None and objtype is self.owner else None


class Muon(StepStatsReporter, torch.optim.Optimizer):
    """``megatron_eopt.muon.Muon``: one name for two optimizers, chosen by the arguments.

    - A flat list of parameters (or param groups without ``use_muon``): Keller Jordan's /
      nanochat's Muon, ``Muon(params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
      weight_decay=0.0, *, backend="newtonschulz5", backend_steps=None, state_dtype="fp32")``,
      this class.
    - Param groups flagged ``use_muon`` (``get_default_muon_param_groups(model)``), or any of
      Motif's keywords (``adamw_betas``, ``adamw_eps``, ``none_grad``, ``clip_config``,
      ``expert_keys``, ``cpu_offload``, ``debug``, ``warmup_step``, ``chunk_size``,
      ``use_distributed_muon``): Motif's Muon, ``Muon(params, lr=1e-3, weight_decay=0.1,
      momentum=0.95, nesterov=True, ns_steps=5, ...)``, an instance of
      :class:`megatron_eopt.compat.motif.MotifMuon`.

    ``lr=None`` / ``weight_decay=None`` (the defaults shown by ``inspect.signature``) take the
    chosen library's own: 0.02 / 0.0 for the snippet, 1e-3 / 0.1 for Motif. Positional arguments
    after ``lr`` follow that library's order (snippet: momentum, nesterov, ns_steps, weight_decay;
    Motif: weight_decay, momentum, nesterov, ns_steps, ...). An argument of one library given to
    the other is refused naming it: ``backend`` / ``backend_steps`` with Motif's groups, Motif's
    keywords with a flat list (TypeError), ``state_dtype`` other than "fp32" with a flat list
    (ValueError: the snippet's Muon keeps nanochat's fp32 ``momentum_buffer``; low-memory state
    is offered with Motif's groups and by :class:`megatron_eopt.optim.Muon`).

    The snippet's Muon, per parameter (2-D, or N-D flattened to ``(size(0), -1)`` like conv
    filters in the popular snippet): decoupled weight decay ``p *= 1 - lr·wd``; momentum
    ``M ← lerp(M, g, 1-momentum)``; Nesterov ``lerp(g, M, momentum)``; ``ns_steps``
    simple-quintic Newton–Schulz iterations in bf16; ``p -= lr·√max(1, p.size(-2)/p.size(-1))·update``.

    Groups keep ``lr``, ``momentum``, ``nesterov``, ``ns_steps`` and ``weight_decay`` (read at
    every step, so schedulers and momentum warmups work); ``nesterov`` and ``ns_steps`` must be
    the same in every group. A flat list of parameters is regrouped as nanochat's ``Muon`` (at
    4ddc803) and modded-nanogpt's do it: one group per distinct ``numel``, in the order Python's
    set of those sizes iterates, parameters in their given order within a group. The state is
    ``momentum_buffer`` shaped like each parameter. So checkpoints load into and from nanochat's
    ``Muon``: the same groups, indices and keys; a group saved without ``weight_decay`` (nanochat
    has none) gets this optimizer's default.
    """

    orthogonalizing = True  # its parameters are "the Muon part" of a clip (megatron_eopt.clipping)

    _legacy_name = "Muon"
    __signature__ = _DispatchSignature()

    def __new__(cls, params: Iterable[Any] = (), *args: Any, **kwargs: Any):
        # Motif's constructor (groups flagged use_muon, AdamW / QK-clip keywords): the hybrid class.
        if cls is Muon:
            params = list(params)
            if motif.is_motif_call(params, kwargs):
                _check_motif_call(params, kwargs)
                _warn_once("MotifMuon")
                obj = motif.MotifMuon.__new__(motif.MotifMuon)
                obj.__init__(params, *args, **kwargs)
                return obj
            obj = super().__new__(cls)
            obj._new_params = params  # a generator was consumed above: __init__ takes this list
            return obj
        return super().__new__(cls)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float | None = 0.0,
        *,
        backend: str = "newtonschulz5",
        backend_steps: int | None = None,
        state_dtype: str = "fp32",
    ) -> None:
        if self._legacy_name == "Muon":  # DistMuon warns under its own name
            _warn_once("Muon")
        _check_snippet_state_dtype(state_dtype)
        lr = SNIPPET_DEFAULTS["lr"] if lr is None else lr
        weight_decay = SNIPPET_DEFAULTS["weight_decay"] if weight_decay is None else weight_decay
        params = self.__dict__.pop("_new_params", params)
        params = _groups_by_numel(params)
        ns_steps = _resolve_steps(ns_steps, backend, backend_steps)
        defaults = dict(lr=lr, momentum=momentum, nesterov=bool(nesterov), ns_steps=ns_steps, weight_decay=weight_decay)
        self._inner = None
        super().__init__(params, defaults)
        self._build_inner()

    # ------------------------------------------------------------------ the fused optimizer
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        for pi, p in enumerate(self.param_groups[gi]["params"]):
            problem = None
            if p.ndim < 2:
                problem = f"has shape {tuple(p.shape)}; Muon takes matrices (optimize 0-D/1-D tensors with AdamW)"
            elif p.ndim > 2 and not p.is_contiguous():
                problem = "is an N-D tensor that is not contiguous (it is flattened to (size(0), -1) by a view)"
            if problem is not None:
                self.param_groups.pop()
                raise ValueError(f"param_groups[{gi}]['params'][{pi}] {problem}")
        if self._inner is not None:
            self._build_inner()

    def _settings(self) -> tuple[bool, int]:
        settings = {(bool(g["nesterov"]), int(g["ns_steps"])) for g in self.param_groups}
        if len(settings) != 1:
            raise ValueError(f"nesterov and ns_steps must be the same in every param group, got {sorted(settings)}")
        return settings.pop()

    def _build_inner(self) -> None:
        """One fused Muon over 2-D handles of the parameters (views: updates land in place).

        An N-D parameter is optimized through its (size(0), -1) view, in an inner group whose lr
        carries the ratio of the snippet's scale to the flattened matrix's (and whose weight
        decay the inverse ratio, so lr·wd is unchanged).
        """
        from ..optim import Muon as FusedMuon

        nesterov, ns_steps = self._settings()
        self._handles: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        inner_groups: list[dict[str, Any]] = []
        self._inner_sources: list[tuple[int, float]] = []  # (outer group, lr ratio) per inner group
        slot: dict[tuple[int, float], int] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                # A DTensor stays whole (the fused optimizer flattens it with nd_mode "flatten" on
                # its local shard); a plain tensor is flattened here by a view.
                sharded = _is_dtensor(p)
                handle = p.detach() if p.ndim == 2 or sharded else p.detach().view(p.shape[0], -1)
                ratio = 1.0
                if p.ndim > 2:
                    rows, cols = p.shape[0], p.numel() // p.shape[0]
                    ratio = _legacy_scale(p.shape) / math.sqrt(max(1.0, rows / cols))
                key = (gi, ratio, sharded)
                if key not in slot:
                    slot[key] = len(inner_groups)
                    inner_groups.append({"params": [], "nd_mode": "flatten"})
                    self._inner_sources.append((gi, ratio))
                inner_groups[slot[key]]["params"].append(handle)
                self._handles.append((p, handle, slot[key]))
        self._inner = FusedMuon(
            inner_groups,
            lr=0.0,
            momentum=0.0,
            weight_decay=0.0,
            nesterov=nesterov,
            num_ns_steps=ns_steps,
            **SNIPPET_MUON,
        )
        self._inner_settings = (nesterov, ns_steps)
        self._link_state()

    def _link_state(self) -> None:
        # Both optimizers see the same momentum memory: ours shaped like p (checkpoint format
        # of the snippets), the fused one's shaped like its 2-D handle.
        for p, handle, _ in self._handles:
            outer = self.state.get(p)
            inner = self._inner.state.get(handle)
            if outer and "momentum_buffer" in outer:
                self._inner.state[handle]["momentum_buffer"] = _view(outer["momentum_buffer"], handle.shape)
            elif inner and "momentum_buffer" in inner:
                self.state[p]["momentum_buffer"] = _view(inner["momentum_buffer"], p.shape)

    def _sync_hyperparameters(self) -> None:
        if self._settings() != self._inner_settings:
            self._build_inner()  # ns_steps or nesterov changed in the groups
        for inner_group, (gi, ratio) in zip(self._inner.param_groups, self._inner_sources):
            group = self.param_groups[gi]
            inner_group["lr"] = group["lr"] * ratio
            inner_group["weight_decay"] = group["weight_decay"] / ratio
            inner_group["momentum"] = group["momentum"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_loaded_state(self, state_dict)  # a misfit is refused before anything changes
        super().load_state_dict(state_dict)
        self._default_group_keys()
        self._build_inner()

    def _default_group_keys(self) -> None:
        # A group saved by a class that lacks a key this one reads (nanochat's Muon has no
        # weight_decay) gets this optimizer's default for it.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    @records_step_stats
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure_loss(closure)
        self._sync_hyperparameters()
        for p, handle, _ in self._handles:
            handle.grad = None if p.grad is None else p.grad.view(handle.shape)
        try:
            self._inner.step()
        finally:
            for _, handle, _ in self._handles:
                handle.grad = None
        self._link_state()
        return loss


def _is_dtensor(t) -> bool:
    from ..optim.multirank.dtensor_layout import is_dtensor

    return is_dtensor(t)


def _view(t: torch.Tensor, shape) -> torch.Tensor:
    return t if tuple(t.shape) == tuple(shape) else t.view(shape)


class DistMuon(Muon):
    """nanochat's data-parallel Muon: every rank holds all parameters and its own grads.

    Parameters are regrouped by shape (shapes sorted, within the given groups), and each group
    holds a ``zero_buffer`` shaped like its parameters, as nanochat's ``DistMuon`` (at 4ddc803)
    keeps them. Every matrix gets one owner rank, which alone keeps its momentum:
    ``owners="nanochat"`` (the default) gives rank r the r-th parameter of each run of world-size
    parameters of a group (index i of a group belongs to rank i % world_size), exactly as nanochat
    does, so each rank's checkpoint loads into nanochat's ``DistMuon`` of the same world size and
    back; ``owners="balanced"`` balances the Newton–Schulz FLOPs across the ranks instead (its
    checkpoints load only under the same assignment). Loading a checkpoint whose momentum belongs
    to another rank here (another world size or assignment) raises instead of restarting that
    momentum from zero. Per chunk of matrices (same shapes next to each other), one all-to-all carries every
    rank's grads to the owners, which average them (a reduce-scatter: each owner receives only
    the grads of what it owns, summed in rank order and divided by the world size), run one fused
    Muon step over their matrices and send the new values to every rank in one all-to-all back.
    The collectives are asynchronous, so chunk i+1's grads travel while chunk i is stepped. The
    update equals :class:`Muon` on the averaged grads; momentum lives on the owner only. Every
    parameter needs a grad on every rank. ``process_group`` defaults to the world.

    DTensor parameters (FSDP2, already reduce-scattered grads) take the sharded path of
    :class:`megatron_eopt.optim.Muon` instead: each matrix is orthogonalized once, by its owner
    rank (all-to-all of the shards), with the same numbers as :class:`Muon` on the full tensors.
    """

    _legacy_name = "DistMuon"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        *,
        backend: str = "newtonschulz5",
        backend_steps: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        owners: str = "nanochat",
    ) -> None:
        _warn_once("DistMuon")
        if owners not in OWNER_RULES:
            raise ValueError(f"owners must be one of {list(OWNER_RULES)}, got {owners!r}")
        self._owners = owners
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistMuon needs torch.distributed to be initialized (init_process_group)")
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError(
                f"process_group does not contain this rank ({dist.get_rank()}): DistMuon runs on every rank of "
                "its group"
            )
        self._pg = process_group
        self._exchanges = None
        super().__init__(
            _groups_by_shape(params),
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            weight_decay=weight_decay,
            backend=backend,
            backend_steps=backend_steps,
        )

    def _build_inner(self) -> None:
        super()._build_inner()
        self._exchanges = None  # the parameters changed: owners are assigned again at the next step

    def _owner_plan(self):
        """(route, [(items, chunks, owners)] per dtype and device): built once per parameter set.

        Items index ``self._handles``; one bucket per dtype and device because each all-to-all
        moves one buffer. Deterministic from the parameter list, so every rank agrees.
        """
        if self._exchanges is None:
            from ..optim.multirank.owner_exchange import ITEMS_PER_RANK, OwnerRoute, assign_owners, ns_flops

            group = self._pg if self._pg is not None else dist.group.WORLD
            size = dist.get_world_size(group)
            route = OwnerRoute(group, tuple(range(size)), dist.get_rank(group), ("dist_muon", id(group)))
            buckets: dict[tuple, list[int]] = {}
            for i, (p, _, _) in enumerate(self._handles):
                buckets.setdefault((p.dtype, p.device), []).append(i)
            plans = []
            position = {id(p): pi for group in self.param_groups for pi, p in enumerate(group["params"])}
            for items in buckets.values():
                # Same-shape matrices next to each other: an owner's matrices of a chunk batch.
                items = sorted(items, key=lambda i: (tuple(self._handles[i][1].shape), i))
                if self._owners == "nanochat":  # index i of its group -> rank i % world size
                    owners = [position[id(self._handles[i][0])] % size for i in items]
                    per_chunk = ITEMS_PER_RANK * size
                    chunks = [list(range(k, min(k + per_chunk, len(items)))) for k in range(0, len(items), per_chunk)]
                else:
                    costs = [ns_flops(tuple(self._handles[i][1].shape)) for i in items]
                    chunks, owners = assign_owners(costs, size, ITEMS_PER_RANK * size)
                plans.append((items, chunks, owners))
            self._exchanges = (route, plans)
        return self._exchanges

    def _default_group_keys(self) -> None:
        super()._default_group_keys()
        for group in self.param_groups:  # nanochat's DistMuon reads it from every group
            if "zero_buffer" not in group:
                group["zero_buffer"] = torch.zeros_like(group["params"][0])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_momentum_owners(state_dict)
        super().load_state_dict(state_dict)

    def _check_momentum_owners(self, state_dict: dict[str, Any]) -> None:
        """Refuses a checkpoint whose momentum cannot follow its parameter: state for a matrix
        another rank owns here, or none for one this rank owns while others have some."""
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            return  # load_state_dict's own error
        if any(_is_dtensor(p) for g in self.param_groups for p in g["params"]):
            return  # DTensor state: every rank holds its shard of every matrix
        states = state_dict.get("state", {})
        if not any("momentum_buffer" in s for s in states.values()):
            return  # nothing stepped yet
        group = self._pg if self._pg is not None else dist.group.WORLD
        me, size = dist.get_rank(group), dist.get_world_size(group)
        for gi, (saved, current) in enumerate(zip(saved_groups, self.param_groups)):
            for pi, (index, p) in enumerate(zip(saved["params"], current["params"])):
                owner = self.owner_of(p)  # a rank of the group, as `me`
                has = "momentum_buffer" in states.get(index, {})
                if has != (owner == me):
                    raise ValueError(
                        f"load_state_dict: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is owned by "
                        f"rank {owner} of {size} here (owners={self._owners!r}), but this rank's checkpoint "
                        f"{'holds' if has else 'lacks'} its momentum_buffer: it was saved at another world size or "
                        "owner assignment, and the momentum cannot follow its parameter. Load each rank's "
                        "checkpoint on the same rank of the same world size; nothing was loaded"
                    )

    def owner_of(self, p: torch.Tensor) -> int:
        """The rank (in ``process_group``) that steps ``p`` and keeps its momentum."""
        route, plans = self._owner_plan()
        for items, _, owners in plans:
            for item, owner in zip(items, owners):
                if self._handles[item][0] is p:
                    return route.peers[owner]
        raise ValueError("owner_of: p is not a parameter of this optimizer")

    @torch.no_grad()
    @records_step_stats
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = closure_loss(closure)
        params = [p for group in self.param_groups for p in group["params"]]
        sharded = [_is_dtensor(p) for p in params]
        if any(sharded):
            if not all(sharded):
                raise ValueError(
                    "DistMuon takes either plain replicated tensors (nanochat's data parallelism) or DTensor "
                    "parameters (FSDP2 / tensor parallel), not both in one optimizer"
                )
            # The grads are reduced already (FSDP2's reduce-scatter); the fused optimizer moves
            # the shards to one owner per matrix and back.
            super().step()
            return loss
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    raise RuntimeError(
                        f"DistMuon needs a grad for every parameter on every rank (all ranks join the same "
                        f"all-to-alls); param_groups[{gi}]['params'][{pi}] has none"
                    )
        self._sync_hyperparameters()
        route, plans = self._owner_plan()
        for _, handle, _ in self._handles:
            handle.grad = None
        for items, chunks, owners in plans:
            self._exchange(route, items, chunks, owners)
        self._link_state()
        return loss

    def _exchange(self, route, items, chunks, owners) -> None:
        """Grads to the owners, the owners' fused step, new values back (one dtype and device)."""
        from ..optim.multirank.owner_exchange import OwnerExchange

        handles = [self._handles[i][1] for i in items]
        grads = [self._handles[i][0].grad for i in items]

        def step_owned(owned, pieces):
            for j, parts in zip(owned, pieces):
                handles[j].grad = _mean_in_rank_order(parts).view(handles[j].shape)
            try:
                self._inner.step()  # only the handles with a grad: this chunk's owned matrices
            finally:
                for j in owned:
                    handles[j].grad = None
            return [handles[j] for j in owned]

        def deliver(j, value):
            if owners[j] != route.me:  # the owner updated its copy in place
                handles[j].copy_(value.view(handles[j].shape))

        OwnerExchange(
            route, chunks, owners,
            to_owner=lambda j, s: handles[j].numel(),
            send=lambda j: grads[j].to(handles[j].dtype),
            compute=step_owned,
            from_owner=lambda j, s: 0 if s == owners[j] else handles[j].numel(),
            back=lambda j, value, s: value[:0] if s == owners[j] else value,
            deliver=deliver,
            like=handles[0],
        ).run()


def _mean_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """The mean of the ranks' flat grads, summed in rank order (the same on every run and owner),
    accumulated in at least fp32 and returned in the grads' dtype."""
    acc = parts[0].to(torch.promote_types(parts[0].dtype, torch.float32), copy=True)
    for part in parts[1:]:
        acc += part
    acc /= len(parts)
    return acc.to(parts[0].dtype)


def _groups_by_numel(params: Iterable[Any]) -> list[Any]:
    """nanochat's (4ddc803) and modded-nanogpt's grouping of a flat parameter list: one group per
    distinct numel, in the iteration order of the set of sizes; param groups pass unchanged."""
    params = list(params)
    if not params or isinstance(params[0], dict):
        return params
    sizes = {p.numel() for p in params}  # a set's order, as theirs: it decides the saved indices
    return [{"params": [p for p in params if p.numel() == size]} for size in sizes]


def _groups_by_shape(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Splits the given params (or groups) into groups of one shape, shapes sorted, each with a
    ``zero_buffer`` (nanochat's DistMuon at 4ddc803)."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    out = []
    for group in groups:
        tensors = list(group["params"])
        options = {k: v for k, v in group.items() if k != "params"}
        for shape in sorted({tuple(p.shape) for p in tensors}):
            members = [p for p in tensors if tuple(p.shape) == shape]
            # nanochat pads its collectives with it and reads it from each group (checkpoints too)
            out.append({"params": members, **options, "zero_buffer": torch.zeros_like(members[0].detach())})
    return out
