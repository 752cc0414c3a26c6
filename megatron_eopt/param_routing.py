"""Split a model's parameters between Muon and AdamW, and say why for each one.

Muon orthogonalizes 2-D hidden matrices; embeddings, output heads, norms, biases, scalars and
N-D tensors belong to AdamW. :func:`build_optimizers` applies these rules and returns the two
optimizers with a :class:`RoutingTable` listing every parameter, where it went and why, so a
misrouted parameter shows up in the table instead of silently training with the wrong method.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TextIO

import torch
from torch import nn

__all__ = [
    "DEFAULT_EMBEDDING_PATTERNS",
    "DEFAULT_HEAD_PATTERNS",
    "Route",
    "RoutingTable",
    "build_optimizers",
    "muon_param_groups",
    "route_parameters",
]

MUON = "muon"
ADAMW = "adamw"
FROZEN = "frozen"

# Regular expressions searched in the full dotted parameter name (case-insensitive).
DEFAULT_EMBEDDING_PATTERNS: tuple[str, ...] = (r"embed", r"(^|\.)(wte|wpe)(\.|$)")
# Output heads: these module names anywhere, plus the generic names `output`, `head` and
# `score` only as top-level modules (`attention.output.dense` in BERT is a hidden matrix).
DEFAULT_HEAD_PATTERNS: tuple[str, ...] = (
    r"(^|\.)(lm_head|output_layer|classifier|unembed)(\.|$)",
    r"^(output|head|score)\.",
)
# Only labels the reason of a 1-D tensor ("norm" vs "1-D vector"); routing is the same.
_NORM_PATTERN = re.compile(r"norm|(^|[._])(ln|bn)\w*\.", re.IGNORECASE)


@dataclass(frozen=True)
class Route:
    """Where one parameter goes. ``names``: every name it has (more than one when tied)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    optimizer: str  # "muon", "adamw" or "frozen"
    reason: str
    weight_decay: float | None

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class RoutingTable:
    """Every parameter with its optimizer and the rule that sent it there."""

    def __init__(self, routes: Sequence[Route]):
        self.routes: list[Route] = list(routes)

    def __iter__(self):
        return iter(self.routes)

    def __len__(self) -> int:
        return len(self.routes)

    def __getitem__(self, name: str) -> Route:
        for route in self.routes:
            if name in route.names:
                return route
        raise KeyError(f"no parameter named {name!r} in the routing table")

    def names_for(self, optimizer: str) -> list[str]:
        """First names of the parameters routed to ``optimizer`` ("muon", "adamw", "frozen")."""
        return [r.name for r in self.routes if r.optimizer == optimizer]

    def summary(self) -> dict[str, tuple[int, int]]:
        """{optimizer: (number of tensors, number of elements)}."""
        out: dict[str, tuple[int, int]] = {}
        for r in self.routes:
            count, numel = out.get(r.optimizer, (0, 0))
            out[r.optimizer] = (count + 1, numel + r.numel)
        return out

    def format(self) -> str:
        rows = [("parameter", "shape", "optimizer", "wd", "reason")]
        for r in self.routes:
            name = r.name if len(r.names) == 1 else f"{r.name} (= {', '.join(r.names[1:])})"
            wd = "-" if r.weight_decay is None else f"{r.weight_decay:g}"
            rows.append((name, "x".join(map(str, r.shape)) or "scalar", r.optimizer, wd, r.reason))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
        totals = ", ".join(f"{opt}: {n} tensors / {numel:,} elements" for opt, (n, numel) in self.summary().items())
        return "\n".join(lines + [totals])

    __str__ = format

    def print(self, file: TextIO | None = None) -> None:
        print(self.format(), file=file if file is not None else sys.stdout)


def _named_parameters(model_or_named_params: Any) -> tuple[list[tuple[torch.Tensor, list[str]]], set[int]]:
    """[(param, [names...])] in first-seen order, and ids of params owned by embedding modules."""
    embedding_module_params: set[int] = set()
    if isinstance(model_or_named_params, nn.Module):
        pairs = list(model_or_named_params.named_parameters(remove_duplicate=False))
        for module in model_or_named_params.modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                embedding_module_params.update(id(p) for p in module.parameters(recurse=False))
    elif isinstance(model_or_named_params, Mapping):
        pairs = list(model_or_named_params.items())
    else:
        pairs = list(model_or_named_params)
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(
                "build_optimizers routes by parameter name: pass an nn.Module, a dict "
                f"{{name: param}} or (name, param) pairs such as model.named_parameters(); item {i} is {pair!r:.80}"
            )
        name, param = pair
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"parameter {name!r} must be a torch.Tensor, got {type(param).__name__}")
        if id(param) in by_id:
            by_id[id(param)][1].append(name)
        else:
            by_id[id(param)] = (param, [name])
    return list(by_id.values()), embedding_module_params


def _storage_key(p: torch.Tensor) -> tuple[str, int] | None:
    if p.device.type == "meta" or p.numel() == 0:
        return None
    return (str(p.device), p.untyped_storage().data_ptr())


def _matches(patterns: Sequence[re.Pattern], names: Sequence[str]) -> str | None:
    for name in names:
        for pattern in patterns:
            if pattern.search(name):
                return name
    return None


def route_parameters(
    model_or_named_params: Any,
    *,
    weight_decay: float = 0.0,
    adamw_weight_decay: float | None = None,
    embedding_patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS,
    head_patterns: Sequence[str] = DEFAULT_HEAD_PATTERNS,
    adamw_patterns: Sequence[str] = (),
    nd_mode: str = "error",
) -> tuple[RoutingTable, dict[str, list[torch.Tensor]]]:
    """The routing of :func:`build_optimizers` without building anything.

    Returns the table and ``{"muon": [...], "adamw_decay": [...], "adamw_no_decay": [...]}``.
    Rules, first match wins: frozen (``requires_grad=False``) → none; ``adamw_patterns`` →
    AdamW; an ``nn.Embedding`` / ``nn.EmbeddingBag`` weight, a Megatron
    ``is_embedding_or_output_parameter`` tag, or an embedding name → AdamW; an output-head
    name → AdamW; sharing storage with an embedding (tied head) → AdamW; 0-D/1-D (scalars,
    biases, norms) → AdamW without weight decay; 2-D → Muon; N-D → AdamW, or Muon when
    ``nd_mode`` is ``"flatten"`` or ``"batch"`` (the Muon optimizer must then be built with the
    same ``nd_mode``).
    """
    if nd_mode not in ("error", "flatten", "batch"):
        raise ValueError(f"nd_mode must be one of ['error', 'batch', 'flatten'], got {nd_mode!r}")
    if adamw_weight_decay is None:
        adamw_weight_decay = weight_decay
    flags = re.IGNORECASE
    emb_re = [re.compile(p, flags) for p in embedding_patterns]
    head_re = [re.compile(p, flags) for p in head_patterns]
    force_re = [re.compile(p, flags) for p in adamw_patterns]

    params, embedding_module_params = _named_parameters(model_or_named_params)

    # First pass: embeddings, whose storage marks tied heads in the second pass.
    embedding_reason: dict[int, str] = {}
    for p, names in params:
        if id(p) in embedding_module_params:
            embedding_reason[id(p)] = "embedding (nn.Embedding)"
        elif getattr(p, "is_embedding_or_output_parameter", False):
            embedding_reason[id(p)] = "embedding/output (is_embedding_or_output_parameter)"
        elif (hit := _matches(emb_re, names)) is not None:
            embedding_reason[id(p)] = f"embedding (name {hit!r})"
    embedding_storage = {}
    for p, names in params:
        if id(p) in embedding_reason and (key := _storage_key(p)) is not None:
            embedding_storage.setdefault(key, names[0])

    routes: list[Route] = []
    groups: dict[str, list[torch.Tensor]] = {"muon": [], "adamw_decay": [], "adamw_no_decay": []}
    seen_storage: dict[tuple[str, int], str] = {}
    for p, names in params:
        key = _storage_key(p)
        if len(names) > 1:
            tied = f" (tied: {', '.join(names)})"
        else:
            tied = ""
        if not p.requires_grad:
            routes.append(Route(tuple(names), tuple(p.shape), FROZEN, "requires_grad=False", None))
            continue
        if key is not None and key in seen_storage and id(p) not in embedding_reason:
            if key not in embedding_storage:
                warnings.warn(
                    f"parameters {seen_storage[key]!r} and {names[0]!r} are distinct tensors sharing storage: "
                    "each optimizer step updates that memory twice",
                    stacklevel=3,
                )
        if key is not None:
            seen_storage.setdefault(key, names[0])

        if (hit := _matches(force_re, names)) is not None:
            optimizer, reason = ADAMW, f"adamw_patterns (name {hit!r})"
        elif id(p) in embedding_reason:
            optimizer, reason = ADAMW, embedding_reason[id(p)]
        elif (hit := _matches(head_re, names)) is not None:
            optimizer, reason = ADAMW, f"output head (name {hit!r})"
        elif key is not None and key in embedding_storage:
            optimizer, reason = ADAMW, f"output head (shares storage with embedding {embedding_storage[key]!r})"
        elif p.dim() == 0:
            optimizer, reason = ADAMW, "scalar"
        elif p.dim() == 1:
            leaf = names[0].rsplit(".", 1)[-1]
            if leaf == "bias" or names[0].endswith("_bias"):
                reason = "bias"
            elif _matches([_NORM_PATTERN], names) is not None:
                reason = "norm"
            else:
                reason = "1-D vector"
            optimizer = ADAMW
        elif p.dim() == 2:
            optimizer, reason = MUON, "2-D hidden matrix"
        elif nd_mode != "error":
            optimizer, reason = MUON, f"{p.dim()}-D tensor (nd_mode={nd_mode!r})"
        else:
            optimizer, reason = ADAMW, f"{p.dim()}-D tensor (Muon takes 2-D matrices)"

        if optimizer == MUON:
            wd = weight_decay
            groups["muon"].append(p)
        elif p.dim() >= 2:
            wd = adamw_weight_decay
            groups["adamw_decay"].append(p)
        else:
            wd = 0.0
            groups["adamw_no_decay"].append(p)
        routes.append(Route(tuple(names), tuple(p.shape), optimizer, reason + tied, wd))
    return RoutingTable(routes), groups


def build_optimizers(
    model_or_named_params: Any,
    *,
    muon_lr: float = 0.02,
    adamw_lr: float = 3e-4,
    weight_decay: float = 0.0,
    adamw_weight_decay: float | None = None,
    momentum: float = 0.95,
    nesterov: bool = True,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    muon_cls: type | None = None,
    muon_kwargs: Mapping[str, Any] | None = None,
    adamw_kwargs: Mapping[str, Any] | None = None,
    embedding_patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS,
    head_patterns: Sequence[str] = DEFAULT_HEAD_PATTERNS,
    adamw_patterns: Sequence[str] = (),
    verbose: bool = False,
) -> tuple[list[torch.optim.Optimizer], RoutingTable]:
    """Muon for 2-D hidden matrices, ``torch.optim.AdamW`` for everything else.

    ``model_or_named_params``: an ``nn.Module``, a ``{name: param}`` dict or ``(name, param)``
    pairs (names are needed: embeddings and heads are recognized by name as well as by module
    type, Megatron tag and tied storage). See :func:`route_parameters` for the rules.

    Muon is ``megatron_eopt.optim.Muon`` unless ``muon_cls`` says otherwise, built with
    ``lr=muon_lr, momentum, nesterov, weight_decay`` and ``scale_mode="shape_scaling"`` (the
    √max(1, m/n) scale that lr ≈ 0.02 is tuned for), updated by ``muon_kwargs``. AdamW gets
    ``adamw_weight_decay`` (default ``weight_decay``) on its matrices and none on 0-D/1-D
    tensors. Returns ``([muon, adamw], table)``, leaving out an optimizer with no parameters;
    ``verbose=True`` prints the table.
    """
    table, groups = route_parameters(
        model_or_named_params,
        weight_decay=weight_decay,
        adamw_weight_decay=adamw_weight_decay,
        embedding_patterns=embedding_patterns,
        head_patterns=head_patterns,
        adamw_patterns=adamw_patterns,
    )
    optimizers: list[torch.optim.Optimizer] = []
    if groups["muon"]:
        if muon_cls is None:
            from .optim import Muon as muon_cls
        kwargs: dict[str, Any] = {"scale_mode": "shape_scaling"}
        kwargs.update(muon_kwargs or {})
        optimizers.append(
            muon_cls(groups["muon"], lr=muon_lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, **kwargs)
        )
    adamw_groups = []
    if groups["adamw_decay"]:
        wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
        adamw_groups.append({"params": groups["adamw_decay"], "weight_decay": wd})
    if groups["adamw_no_decay"]:
        adamw_groups.append({"params": groups["adamw_no_decay"], "weight_decay": 0.0})
    if adamw_groups:
        optimizers.append(
            torch.optim.AdamW(adamw_groups, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps, **dict(adamw_kwargs or {}))
        )
    if verbose:
        table.print()
    return optimizers, table


def muon_param_groups(
    model_or_named_params: Any,
    *,
    verbose: bool = False,
    embedding_patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS,
    head_patterns: Sequence[str] = DEFAULT_HEAD_PATTERNS,
    adamw_patterns: Sequence[str] = (),
    nd_mode: str = "error",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(muon_params, other_params)``: the parameters a Muon optimizer takes and the rest, for AdamW.

    The rules and arguments of :func:`route_parameters` (those of :func:`build_optimizers`):
    2-D hidden matrices go to Muon; embeddings, output heads (tied ones too), norms, biases,
    scalars and N-D tensors to the other list; frozen parameters to neither. ``nd_mode="flatten"``
    or ``"batch"`` sends N-D tensors to Muon too, for a Muon built with that ``nd_mode``
    (``megatron_eopt.torch_optim.Muon``); the default suits ``torch.optim.Muon``, which takes 2-D
    parameters only. Each list is in the model's parameter order, a tied parameter once.
    ``verbose=True`` prints the routing table (every parameter, where it went and why).
    """
    if not isinstance(model_or_named_params, (nn.Module, Mapping)):
        model_or_named_params = list(model_or_named_params)  # read twice below
    table, groups = route_parameters(
        model_or_named_params,
        embedding_patterns=embedding_patterns,
        head_patterns=head_patterns,
        adamw_patterns=adamw_patterns,
        nd_mode=nd_mode,
    )
    if verbose:
        table.print()
    muon = {id(p) for p in groups["muon"]}
    other = {id(p) for p in groups["adamw_decay"] + groups["adamw_no_decay"]}
    params = [p for p, _ in _named_parameters(model_or_named_params)[0]]
    return [p for p in params if id(p) in muon], [p for p in params if id(p) in other]
