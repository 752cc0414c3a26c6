"""Split a model's parameters between Muon and AdamW, and say why for each one.

Muon orthogonalizes hidden matrices; embeddings, output heads, norms, biases, scalars and
unrecognized N-D tensors belong to AdamW. Given a model and ``example_inputs`` (a transformers model
without them: its dummy inputs), the routing first reads how one forward pass uses each weight
(:mod:`megatron_eopt.param_use`): multiplied as (out, in) or (in, out), per expert, its output split
into fused blocks, a router, an output head, a lookup table, elementwise only. It also reads the
model's modules (:mod:`megatron_eopt.model_views`): a ``Conv1D`` weight is an (out, in) matrix
stored transposed, a fused QKV or gate/up projection is split into its matrices, a transformers MoE
experts parameter is one matrix per expert, a router goes to AdamW; where the two disagree the use
wins, with a warning. :func:`build_optimizers` applies these
rules and returns the two optimizers with a :class:`RoutingTable` listing every parameter, where it
went, its matrix view and scale, and why, so a misrouted parameter shows up in the table instead
of silently training with the wrong method.
"""

from __future__ import annotations

import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TextIO

import torch
from torch import nn

from .model_views import MatrixView, check_view_options, check_view_overrides, model_matrix_views
from .coefficients import get_muon_scale_factor
from .optim.matrix_view import check_nd_mode
from .param_use import ParameterUses, ParamUse, _is_transformers_model, trace_parameter_uses
from .param_use_sharded import is_sharded, sharded_trace_problem

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
# "unembed" is not an embedding (Gemma-3n's altup_unembed_projections are hidden matrices).
DEFAULT_EMBEDDING_PATTERNS: tuple[str, ...] = (r"(?<!un)embed", r"(^|\.)(wte|wpe)(\.|$)")
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
    view: str = ""  # the Muon matrices, e.g. "96x32" or "4 x [24x32 + 24x32]"
    scale: str = ""  # their shape-dependent Muon scale(s)
    group_keys: tuple[tuple[str, Any], ...] = ()  # the Muon param-group keys of its view
    source: str = ""  # what the decision was read from: "use", "table", "shape" or "override"

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

    def __init__(self, routes: Sequence[Route], muon_groups: Sequence[dict] = ()):
        self.routes: list[Route] = list(routes)
        # The Muon parameters as param-group dicts, one per matrix view (its group keys).
        self.muon_groups: list[dict] = list(muon_groups)

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
        rows = [("parameter", "shape", "optimizer", "wd", "muon view (out x in)", "scale", "from", "reason")]
        for r in self.routes:
            name = r.name if len(r.names) == 1 else f"{r.name} (= {', '.join(r.names[1:])})"
            wd = "-" if r.weight_decay is None else f"{r.weight_decay:g}"
            rows.append((name, "x".join(map(str, r.shape)) or "scalar", r.optimizer, wd, r.view or "-",
                         r.scale or "-", r.source or "-", r.reason))
        widths = [max(len(row[i]) for row in rows) for i in range(7)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:7], widths)) + "  " + row[7] for row in rows]
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
    if hasattr(p, "to_local"):  # a DTensor (FSDP2, tensor parallel): its shard's memory on this rank
        p = p.to_local()
    if p.device.type == "meta" or p.numel() == 0:
        return None
    return (str(p.device), p.untyped_storage().data_ptr())


def _matches(patterns: Sequence[re.Pattern], names: Sequence[str]) -> str | None:
    for name in names:
        for pattern in patterns:
            if pattern.search(name):
                return name
    return None


def _by_shape(p: torch.Tensor, names: Sequence[str], nd_mode: str) -> tuple[str, str]:
    """The shape rules: scalars, biases, norms and vectors to AdamW; 2-D to Muon; N-D by ``nd_mode``."""
    if p.dim() == 0:
        return ADAMW, "scalar"
    if p.dim() == 1:
        leaf = names[0].rsplit(".", 1)[-1]
        if leaf == "bias" or names[0].endswith("_bias"):
            return ADAMW, "bias"
        if _matches([_NORM_PATTERN], names) is not None:
            return ADAMW, "norm"
        return ADAMW, "1-D vector"
    if p.dim() == 2:
        return MUON, "2-D hidden matrix"
    if nd_mode != "error":
        return MUON, f"{p.dim()}-D tensor (nd_mode={nd_mode!r})"
    return ADAMW, f"{p.dim()}-D tensor of an unrecognized module (not given to Muon)"


# The uses that decide a route; "unused" and "unknown" leave it to the tables and the shape.
_DECIDED = ("matrix", "router", "head", "embedding", "tied", "not_matrix", "unsupported")


def _by_use(use: ParamUse, table_view: MatrixView | None, table_optimizer: str):
    """(optimizer, reason, view, no weight decay) read from the traced use; None where the use and
    the table both say AdamW (the table's reason and weight decay are the more specific)."""
    what = f"use: {use.seen}"
    if use.kind == "matrix":
        view = use.view
        if table_view is not None and table_view.kind == "mla" and view.matrix_layout == table_view.matrix_layout \
                and view.nd_mode == table_view.nd_mode:
            return MUON, table_view.what, table_view, False  # MLA's factors whole: a recipe choice
        return MUON, view.what, view, False
    if use.kind == "router":
        return (MUON if use.view.optimizer == MUON else ADAMW), f"MoE router ({what})", use.view, False
    if table_optimizer == ADAMW and (table_view is None or table_view.kind != "router"):
        return None
    if use.kind == "unsupported":
        return ADAMW, f"matrices Muon cannot be given ({what})", None, False
    if use.kind == "head":
        return ADAMW, f"output head ({what})", None, False
    if use.kind in ("embedding", "tied"):
        return ADAMW, f"embedding ({what})", None, False
    return ADAMW, f"not a matrix ({what})", None, True


def _differs(decided, optimizer: str, view: MatrixView | None) -> bool:
    new_optimizer, _, new_view, _ = decided
    if new_optimizer != optimizer:
        return True
    if optimizer != MUON:
        return False
    old_keys = (view or MatrixView("linear", "")).group_keys()
    return (new_view or MatrixView("linear", "")).group_keys() != old_keys


def _trace(model: Any, example_inputs: Any, fused_gate_up: str, routers: str) -> ParameterUses | None:
    """The traced uses of ``model``'s parameters, or None where nothing is traced: ``example_inputs``
    False, no module, or None for a model that is not a transformers model or whose DTensor
    parameters the trace cannot read (tensor parallelism: a warning; with example_inputs, a ValueError)."""
    if example_inputs is False:
        return None
    if not isinstance(model, nn.Module):
        if example_inputs is not None:
            raise TypeError("example_inputs needs the model as an nn.Module (a forward to run), got "
                            f"{type(model).__name__}")
        return None
    if example_inputs is None and not _is_transformers_model(model):
        return None
    if example_inputs is None and is_sharded(model) and (problem := sharded_trace_problem(model)) is not None:
        warnings.warn(f"the forward is not traced (routed by the tables and shapes): {problem}", stacklevel=4)
        return None
    try:
        uses = trace_parameter_uses(model, example_inputs, fused_gate_up=fused_gate_up, routers=routers)
    except TypeError as exc:
        if example_inputs is not None:
            raise
        uses = ParameterUses({}, error=f"its dummy inputs: {exc}")  # a transformers model's own inputs
    if uses.error is not None and example_inputs is not None:
        import inspect

        try:
            signature = str(inspect.signature(model.forward))
        except (TypeError, ValueError):
            signature = "(...)"
        raise ValueError(f"example_inputs: {type(model).__name__}.forward{signature} failed on them: {uses.error}")
    return uses


def route_parameters(
    model_or_named_params: Any,
    *,
    weight_decay: float = 0.0,
    adamw_weight_decay: float | None = None,
    embedding_patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS,
    head_patterns: Sequence[str] = DEFAULT_HEAD_PATTERNS,
    adamw_patterns: Sequence[str] = (),
    nd_mode: str = "error",
    fused_gate_up: str = "split",
    routers: str = "adamw",
    views: Mapping[str, Any] | None = None,
    scale_mode: str = "shape_scaling",
    example_inputs: Any = None,
) -> tuple[RoutingTable, dict[str, list]]:
    """The routing of :func:`build_optimizers` without building anything.

    Returns the table and ``{"muon": [...], "adamw_decay": [...], "adamw_no_decay": [...]}``.
    The table's ``muon_groups`` are the Muon side as param-group dicts, one per matrix view, with
    its ``nd_mode`` / ``matrix_layout`` / ``split_shapes`` keys.
    ``example_inputs``: one forward call's inputs (a tuple of args, a dict of kwargs or a tensor) on
    which the forward is traced (:func:`megatron_eopt.param_use.trace_parameter_uses`, on meta
    tensors where it can run there); the use it shows decides each weight of two or more dims before
    the rules below (docs/compatibility.md, "How routing decides"). None: a transformers model is
    traced on its ``dummy_inputs``, another model not; False: no trace. Inputs that do not bind to
    ``forward`` are a TypeError, a forward that fails on them a ValueError, both naming its
    signature; weights the trace could not read are named in a warning.
    Rules, first match wins: frozen (``requires_grad=False``) → none; ``adamw_patterns`` →
    AdamW; ``views`` → that view; the traced use; an ``nn.Embedding`` / ``nn.EmbeddingBag`` weight, a Megatron
    ``is_embedding_or_output_parameter`` tag, or an embedding name → AdamW; an output-head
    name → AdamW; sharing storage with an embedding (tied head) → AdamW; a parameter of a module
    :func:`megatron_eopt.model_views.model_matrix_views` recognizes (``Conv1D``, fused QKV and
    gate/up projections, transformers MoE experts, MLA projections, routers) → its view
    (``fused_gate_up`` and ``routers`` choose two of them; ``views={name: MatrixView | dict | None}``
    sets a parameter's view by hand, None for the plain rules); 0-D/1-D (scalars, biases, norms) →
    AdamW without weight decay; 2-D → Muon; other N-D → AdamW with a warning naming them, or Muon
    when ``nd_mode`` is ``"flatten"`` or ``"batch"``. ``scale_mode`` only fills the table's scale
    column. A pattern of ``adamw_patterns`` or a name of ``views`` that matches no parameter is a
    ValueError.
    """
    check_nd_mode(nd_mode)
    if adamw_weight_decay is None:
        adamw_weight_decay = weight_decay
    flags = re.IGNORECASE
    emb_re = [re.compile(p, flags) for p in embedding_patterns]
    head_re = [re.compile(p, flags) for p in head_patterns]
    force_re = [re.compile(p, flags) for p in adamw_patterns]

    params, embedding_module_params = _named_parameters(model_or_named_params)
    all_names = {n for _, names in params for n in names}
    for pattern in force_re:
        if not any(pattern.search(n) for n in all_names):
            raise ValueError(f"adamw_patterns: {pattern.pattern!r} matches no parameter name of the model")
    check_view_options(fused_gate_up, routers)
    model_views = {}
    if isinstance(model_or_named_params, nn.Module):
        model_views = {i: v for i, (_, v) in model_matrix_views(model_or_named_params, fused_gate_up=fused_gate_up,
                                                                   routers=routers).items()}
    overrides = check_view_overrides(views, all_names)
    overridden: set[int] = set()
    for p, names in params:
        for name in names:
            if name in overrides:
                overridden.add(id(p))
                if overrides[name] is None:
                    model_views.pop(id(p), None)
                else:
                    model_views[id(p)] = overrides[name]
    unrecognized: list[str] = []
    uses = _trace(model_or_named_params, example_inputs, fused_gate_up, routers)
    disagree: list[str] = []
    shape_only: list[str] = []
    not_understood: list[str] = []

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
    muon_groups: dict[tuple, list[torch.Tensor]] = {}
    seen_storage: dict[tuple[str, int], str] = {}
    for p, names in params:
        key = _storage_key(p)
        if len(names) > 1:
            tied = f" (tied: {', '.join(names)})"
        else:
            tied = ""
        if not p.requires_grad:
            routes.append(Route(tuple(names), tuple(p.shape), FROZEN, "requires_grad=False", None, source="override"))
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

        view = None
        no_decay = False
        source = "table"
        if (hit := _matches(force_re, names)) is not None:
            optimizer, reason, source = ADAMW, f"adamw_patterns (name {hit!r})", "override"
        elif id(p) in overridden:
            view = model_views.get(id(p))
            if view is not None:
                optimizer, reason = (MUON if view.optimizer == "muon" else ADAMW), view.what
            else:
                optimizer, reason = _by_shape(p, names, nd_mode)
            source = "override"
        elif getattr(p, "is_embedding_or_output_parameter", False):
            optimizer, reason = ADAMW, embedding_reason[id(p)]
        else:
            if id(p) in embedding_reason:
                optimizer, reason = ADAMW, embedding_reason[id(p)]
            elif (hit := _matches(head_re, names)) is not None:
                optimizer, reason = ADAMW, f"output head (name {hit!r})"
            elif key is not None and key in embedding_storage:
                optimizer, reason = ADAMW, f"output head (shares storage with embedding {embedding_storage[key]!r})"
            elif (view := model_views.get(id(p))) is not None:
                optimizer, reason = (MUON if view.optimizer == "muon" else ADAMW), view.what
            else:
                optimizer, reason = _by_shape(p, names, nd_mode)
                source = "shape"
                if optimizer == MUON and p.dim() > 2:
                    view = MatrixView("nd", reason, nd_mode=nd_mode)
            use = uses.uses.get(id(p)) if uses is not None and p.dim() >= 2 else None
            if use is not None and use.kind in _DECIDED:
                decided = _by_use(use, view, optimizer)
                if decided is None:  # the use agrees with the table on AdamW: its reason and decay stay
                    source = "use + table"
                else:
                    if source != "shape" and _differs(decided, optimizer, view):
                        disagree.append(f"{names[0]} ({reason} -> {decided[1]})")
                    (optimizer, reason, view, no_decay), source = decided, "use"
                    if use.kind == "unsupported":
                        not_understood.append(f"{names[0]}: {use.seen} (given to AdamW)")
            elif use is not None and use.kind == "unknown":
                reason += f" (use not read: {use.seen})"
                if source == "shape" or optimizer == MUON:  # a table sending it to AdamW needs no warning
                    not_understood.append(f"{names[0]}: {use.seen} (routed by {source})")
            elif uses is not None and source == "shape" and p.dim() >= 2:
                shape_only.append(names[0])
            if source == "shape" and optimizer == ADAMW and p.dim() > 2:
                unrecognized.append(names[0])

        view_text = scale_text = ""
        keys: tuple = ()
        if optimizer == MUON:
            wd = weight_decay
            groups["muon"].append(p)
            if view is None:
                view = MatrixView("linear", "2-D hidden matrix")
            keys = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in view.group_keys().items())
            muon_groups.setdefault(keys, []).append(p)
            view_text = view.describe(tuple(p.shape))
            scales = [get_muon_scale_factor(o, i, scale_mode) for o, i in view.matrices(tuple(p.shape))[1]]
            scale_text = " / ".join(f"{x:.3g}" for x in scales)
        elif no_decay or (view is not None and view.kind in ("expert_bias", "not_matrix")):
            wd = 0.0
            groups["adamw_no_decay"].append(p)
        elif p.dim() >= 2:
            wd = adamw_weight_decay
            groups["adamw_decay"].append(p)
        else:
            wd = 0.0
            groups["adamw_no_decay"].append(p)
        routes.append(Route(tuple(names), tuple(p.shape), optimizer, reason + tied, wd, view_text, scale_text, keys,
                            source))
    if unrecognized:
        warnings.warn(
            f"{len(unrecognized)} parameter(s) of more than two dims belong to modules the routing does not know, "
            f"so they go to AdamW: {unrecognized[:5]}{' ...' if len(unrecognized) > 5 else ''}. Give them to Muon "
            "with nd_mode='batch' (stacked matrices) or 'flatten' (convolutions), or with views={name: ...}; "
            "adamw_patterns keeps them on AdamW without this warning",
            stacklevel=3,
        )
    if disagree:
        warnings.warn(
            f"the forward's use of {len(disagree)} parameter(s) disagrees with the routing tables; the use wins: "
            f"{disagree[:5]}{' ...' if len(disagree) > 5 else ''}",
            stacklevel=3,
        )
    if not_understood:
        warnings.warn(
            f"the traced forward did not say what matrices {len(not_understood)} parameter(s) hold: "
            f"{not_understood[:5]}{' ...' if len(not_understood) > 5 else ''}; views= or adamw_patterns= decide them",
            stacklevel=3,
        )
    if shape_only:
        why = f"could not be traced ({uses.error})" if uses is not None and uses.error else "was traced"
        warnings.warn(
            f"the model {why}, and {len(shape_only)} parameter(s) were routed by their shape alone (no use seen, no "
            f"table): {shape_only[:5]}{' ...' if len(shape_only) > 5 else ''}; views= or adamw_patterns= decide them",
            stacklevel=3,
        )
    param_groups = [
        dict({k: list(v) if isinstance(v, tuple) else v for k, v in keys}, params=ps) for keys, ps in muon_groups.items()
    ]
    return RoutingTable(routes, param_groups), groups


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
    fused_gate_up: str = "split",
    routers: str = "adamw",
    views: Mapping[str, Any] | None = None,
    verbose: bool = False,
    example_inputs: Any = None,
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
    ``verbose=True`` prints the table. Matrices with a view (``Conv1D``, fused projections, MoE
    experts: ``fused_gate_up``, ``routers`` and ``views`` as in :func:`route_parameters`) get Muon
    param groups of their own with the view's keys, which a ``muon_cls`` of ``megatron_eopt.optim``
    takes; another ``muon_cls`` is refused for such a model (ValueError) rather than given weights
    it would orthogonalize as stored. ``example_inputs``: see :func:`route_parameters`.
    """
    kwargs: dict[str, Any] = {"scale_mode": "shape_scaling"}
    kwargs.update(muon_kwargs or {})
    table, groups = route_parameters(
        model_or_named_params,
        weight_decay=weight_decay,
        adamw_weight_decay=adamw_weight_decay,
        embedding_patterns=embedding_patterns,
        head_patterns=head_patterns,
        adamw_patterns=adamw_patterns,
        fused_gate_up=fused_gate_up,
        routers=routers,
        views=views,
        scale_mode=kwargs["scale_mode"] if isinstance(kwargs["scale_mode"], str) else "shape_scaling",
        example_inputs=example_inputs,
    )
    optimizers: list[torch.optim.Optimizer] = []
    if groups["muon"]:
        if muon_cls is None:
            from .optim import Muon as muon_cls
        muon_groups = table.muon_groups
        if any(len(g) > 1 for g in muon_groups):
            from .optim.orthogonalized import OrthogonalizedOptimizer

            if not (isinstance(muon_cls, type) and issubclass(muon_cls, OrthogonalizedOptimizer)):
                viewed = [r.name for r in table if r.optimizer == MUON and r.group_keys][:3]
                raise ValueError(
                    f"muon_cls {getattr(muon_cls, '__name__', muon_cls)!r} takes no matrix views, and the model has "
                    f"weights Muon must see as other matrices than stored (e.g. {viewed}): use a Muon of "
                    "megatron_eopt.optim (the default), or route those weights with views={name: None}"
                )
        optimizers.append(
            muon_cls(muon_groups, lr=muon_lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, **kwargs)
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
    fused_gate_up: str = "split",
    routers: str = "adamw",
    views: Mapping[str, Any] | bool | None = None,
    as_groups: bool = False,
    example_inputs: Any = None,
) -> tuple[list, list[torch.Tensor]]:
    """``(muon_params, other_params)``: the parameters a Muon optimizer takes and the rest, for AdamW.

    The rules and arguments of :func:`route_parameters` (those of :func:`build_optimizers`):
    2-D hidden matrices go to Muon; embeddings, output heads (tied ones too), norms, biases,
    scalars and N-D tensors to the other list; frozen parameters to neither. ``nd_mode="flatten"``
    or ``"batch"`` sends N-D tensors to Muon too, for a Muon built with that ``nd_mode``
    (``megatron_eopt.torch_optim.Muon``); the default suits ``torch.optim.Muon``, which takes 2-D
    parameters only. Each list is in the model's parameter order, a tied parameter once.
    ``verbose=True`` prints the routing table (every parameter, where it went and why).

    A model's weights that Muon must see as other matrices than stored (``Conv1D``, fused QKV and
    gate/up projections, transformers MoE experts; see :func:`route_parameters`) need param-group
    keys a flat list cannot carry: ``as_groups=True`` returns the Muon side as param-group dicts
    with those keys, for ``megatron_eopt.optim.Muon`` or ``megatron_eopt.torch_optim.Muon``.
    Without it, such 2-D weights stay in the flat Muon list and 3-D experts go to the other list,
    with a warning naming them. ``example_inputs``: see :func:`route_parameters`.
    """
    if not isinstance(model_or_named_params, (nn.Module, Mapping)):
        model_or_named_params = list(model_or_named_params)  # read twice below
    table, groups = route_parameters(
        model_or_named_params,
        embedding_patterns=embedding_patterns,
        head_patterns=head_patterns,
        adamw_patterns=adamw_patterns,
        nd_mode=nd_mode,
        fused_gate_up=fused_gate_up,
        routers=routers,
        views=views,
        example_inputs=example_inputs,
    )
    if verbose:
        table.print()
    muon_groups = table.muon_groups
    if as_groups:
        other = {id(p) for p in groups["adamw_decay"] + groups["adamw_no_decay"]}
        params = [p for p, _ in _named_parameters(model_or_named_params)[0]]
        return muon_groups, [p for p in params if id(p) in other]
    # Stacked matrices (experts) under another nd_mode than the caller's Muon takes: the other list.
    batched = {id(p) for g in muon_groups if g.get("nd_mode") not in (None, nd_mode) for p in g["params"]}
    groups["muon"] = [p for p in groups["muon"] if id(p) not in batched]
    groups["adamw_decay"] = groups["adamw_decay"] + [p for g in muon_groups for p in g["params"] if id(p) in batched]
    names = [r.name for r in table
             if r.optimizer == MUON and any(k != "nd_mode" or v != nd_mode for k, v in r.group_keys)]
    if names:
        warnings.warn(
            f"muon_param_groups: {len(names)} weight(s) need a matrix view a flat list cannot carry ({names[:3]}"
            f"{' ...' if len(names) > 3 else ''}): pass as_groups=True for param groups with their views",
            stacklevel=2,
        )
    muon = {id(p) for p in groups["muon"]}
    other = {id(p) for p in groups["adamw_decay"] + groups["adamw_no_decay"]}
    params = [p for p, _ in _named_parameters(model_or_named_params)[0]]
    return [p for p in params if id(p) in muon], [p for p in params if id(p) in other]
