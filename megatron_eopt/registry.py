"""Registry of optimizer entries: what a trainer needs to build and checkpoint each optimizer.

An :class:`EmergingOptimizerEntry` carries the optimizer class, a function that creates every
state tensor up front (checkpoint formats need the state before the first step), a function
mapping a Megatron-LM ``OptimizerConfig`` to constructor arguments (:func:`config_kwargs`: every
``muon_<name>`` field to the argument ``<name>``, an unknown one an error), and per-parameter overrides
(by default: non-matrix, embedding/output and ``use_muon = False`` parameters go to Adam). The
entries have the same fields as Megatron-LM's registry, so :mod:`megatron_eopt.integrations.megatron`
can put them into ``megatron.core.optimizer``; nothing here imports megatron-core.

Built-in entries: ``"muon"`` (:class:`~megatron_eopt.optim.TensorParallelMuon`),
``"adaptive_muon"`` (:class:`~megatron_eopt.optim.TensorParallelAdaptiveMuon`), and the rest of
Emerging-Optimizers 0.4's family: ``"scion"``, ``"mop"``, ``"polargrad"``, ``"spel"``, ``"muown"``,
``"muon_hyperball"`` (its radius from the config's ``muon_hyperball_radius``); ``"muon_ht"``
(:class:`~megatron_eopt.optim.TensorParallelMuonHT`, Megatron-LM PR #6422's tensor-parallel hyperball).

Emerging-Optimizers' own class registry is here too: :func:`register_optimizer`,
:func:`get_optimizer_cls`, :func:`get_optimizer_name_list`, :func:`validate_optimizer_args`,
:func:`get_configured_optimizer_cls`, with megatron-eopt's classes under EO's names.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "EmergingOptimizerEntry",
    "ParamRule",
    "get",
    "get_configured_optimizer_cls",
    "get_optimizer_cls",
    "get_optimizer_name_list",
    "constructor_only_arguments",
    "init_optimizer_state",
    "is_muon_excluded",
    "is_nonlinear_or_embedding",
    "names",
    "qkv_split_shapes_from_model_config",
    "register",
    "register_optimizer",
    "validate_optimizer_args",
]


@dataclass(frozen=True)
class ParamRule:
    """A named parameter predicate, hashable by name (so it can key an overrides dict)."""

    name: str
    fn: Callable[[torch.Tensor], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.Tensor) -> bool:
        return bool(self.fn(param))


def is_nonlinear_or_embedding(param: torch.Tensor) -> bool:
    """True for parameters an orthogonalizing optimizer must not own.

    Megatron-LM's rule: anything that is not a 2-D matrix (biases, norms, scalars, N-D
    tensors) and any parameter tagged ``is_embedding_or_output_parameter`` (word embeddings,
    output layer). Untagged 2-D matrices (e.g. learned position embeddings) stay with Muon,
    exactly as in Megatron-LM.
    """
    return bool(getattr(param, "is_embedding_or_output_parameter", False)) or param.dim() != 2


def is_muon_excluded(param: torch.Tensor) -> bool:
    """True for parameters the scalar optimizer (Adam) takes instead of Muon.

    Megatron-LM's rule: a parameter marked ``use_muon = False`` (Megatron-LM sets it on e.g. the
    Mamba / gated-delta input projections), and every parameter
    :func:`is_nonlinear_or_embedding` matches.
    """
    return getattr(param, "use_muon", True) is False or is_nonlinear_or_embedding(param)


# The predicates of the built-in routing rule (Megatron-LM's own rule). An entry whose overrides
# use only these defers to Megatron-LM's rule once installed there (see integrations.megatron).
DEFAULT_ROUTING_FNS = (is_muon_excluded, is_nonlinear_or_embedding)


def _route_nonlinear_to_adam() -> dict[Any, dict[str, Any]]:
    return {ParamRule("muon_excluded", is_muon_excluded): {"optimizer": "adam"}}


def uses_default_routing(entry: "EmergingOptimizerEntry") -> bool:
    """Whether ``entry`` routes parameters by the built-in rule only (and so, inside
    Megatron-LM, by Megatron-LM's own rule)."""
    overrides = entry.default_param_overrides
    return bool(overrides) and all(
        isinstance(rule, ParamRule) and rule.fn in DEFAULT_ROUTING_FNS and value == {"optimizer": "adam"}
        for rule, value in overrides.items()
    )


@torch.no_grad()
def init_optimizer_state(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """Creates every state tensor of ``opt`` for all of its parameters, with or without grads.

    Megatron-LM calls this as ``init_state_fn(optimizer, config)`` before loading a checkpoint,
    so that the state dict has the structure to load into. ``config`` is accepted and unused.
    """
    del config
    if hasattr(opt, "init_state"):
        opt.init_state()
        return
    init_group = getattr(opt, "_init_group", None)
    # Emerging-Optimizers style classes (torch's own optimizers have an unrelated _init_group)
    if init_group is not None and "skip_non_grad_params" in inspect.signature(init_group).parameters:
        for group in opt.param_groups:
            init_group(group, skip_non_grad_params=False)
        return
    raise TypeError(f"{type(opt).__name__} has neither init_state() nor _init_group(): cannot create its state")


@dataclass
class EmergingOptimizerEntry:
    """Everything needed to create, configure and checkpoint one optimizer.

    Attributes:
        optimizer_cls: the ``torch.optim.Optimizer`` subclass.
        init_state_fn: ``(optimizer, config=None) -> None``; creates all state tensors.
        config_to_kwargs: ``(config, model_chunks, pg_collection) -> dict`` of constructor
            keyword arguments (Megatron-LM ``OptimizerConfig`` in, ``params`` excluded), or
            None for an optimizer configured by its defaults.
        default_param_overrides: ``{rule: overrides}`` applied to every parameter the rule
            matches; a rule is a :class:`ParamRule` (or a Megatron ``ParamKey``, passed through
            as is). ``{"optimizer": "adam"}`` sends matching parameters to Adam.
        constructor_only_kwargs: constructor arguments that configure the whole optimizer and so
            cannot be set per parameter group (the field of the same name that Megatron-LM's
            optimizer-recipe proposal, #5925, adds to its entry; handed to a megatron-core whose entry
            has it). Empty: no such argument declared.
    """

    optimizer_cls: type
    init_state_fn: Callable[..., None] = init_optimizer_state
    config_to_kwargs: Callable[[Any, Any, Any], dict[str, Any]] | None = None
    default_param_overrides: dict[Any, dict[str, Any]] = field(default_factory=_route_nonlinear_to_adam)
    constructor_only_kwargs: frozenset[str] = field(default_factory=frozenset)


def constructor_only_arguments(optimizer_cls: type, per_group: Sequence[str]) -> frozenset[str]:
    """The keyword arguments of ``optimizer_cls``'s constructor other than ``params`` and the
    ``per_group`` values (those kept in each param group, e.g. lr, momentum, weight_decay)."""
    return frozenset(n for n, p in inspect.signature(optimizer_cls).parameters.items()
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n != "params" and n not in per_group)


# ------------------------------------------------------------------ Megatron config mapping
# Megatron-LM's rule (megatron/core/optimizer/emerging_optimizers.py, 0.18 to main): a constructor
# argument ``<name>`` takes the config's ``<prefix>_<name>``, else its unprefixed ``<name>`` (lr,
# weight_decay); the prefix is "muon" for Muon, "muon" then "adaptive_muon" for AdaptiveMuon, the
# entry's name for the others. Ours is the same rule run from the config's side as well: every
# ``<prefix>_*`` field (dataclass fields and attributes set on the config) must reach a constructor
# argument of that name or be one of the fields below, else config_to_kwargs raises naming it, so a
# field of a newer Megatron-LM is never silently dropped. Like Megatron-LM, weight decay is always
# decoupled (OptimizerConfig.decoupled_weight_decay is Adam's switch).

# ``<prefix>_*`` fields that are not constructor arguments, and what reads them instead.
CONSUMED_CONFIG_FIELDS: dict[str, str] = {
    # Megatron-LM's factory: the optimizer of the parameters Muon does not take (adam or lion).
    "muon_scalar_optimizer": "Megatron-LM's factory (the scalar parameters' optimizer)",
    # megatron_eopt.integrations.megatron_clipping: how the chained optimizer clips (ours only).
    "muon_clip_policy": "megatron_eopt.integrations.megatron_clipping (the chained optimizer's clip)",
}

# Older spellings of a field, mapped to the argument they meant (Megatron-LM before 0.18 called
# muon_nesterov muon_use_nesterov).
RENAMED_CONFIG_FIELDS: dict[str, str] = {
    "muon_use_nesterov": "nesterov",
}

# Arguments the entries compute themselves (from the model and the process groups), never from a field.
_DERIVED_ARGUMENTS = frozenset({"params", "is_qkv_fn", "qkv_split_shapes", "pg_collection"})


def _config_field_names(config: Any) -> list[str]:
    """The config's dataclass fields and the attributes set on it, in that order, without repeats."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config) else []
    names += [n for n in getattr(config, "__dict__", {}) if n not in names]
    return names


def _megatron_core_label() -> str:
    from ._megatron_version import megatron_core_version  # reads metadata; does not import megatron

    version = megatron_core_version()
    return "megatron-core " + (".".join(map(str, version)) if version else "(not installed)")


def _strip_prefix(field_name: str, prefixes: Sequence[str]) -> str:
    """``field_name`` without the longest of ``prefixes`` (+ "_") it starts with."""
    matching = [p for p in prefixes if field_name.startswith(p + "_")]
    return field_name[len(max(matching, key=len)) + 1:] if matching else field_name


class UnknownConfigFieldError(ValueError):
    """A config field with an entry's prefix that neither the constructor nor megatron-eopt knows."""


def config_kwargs(optimizer_cls: type, config: Any, prefixes: Sequence[str], *,
                  tolerated: Callable[[str], bool] | None = None, entry_name: str | None = None,
                  arguments: Sequence[str] | None = None) -> dict[str, Any]:
    """Constructor keyword arguments of ``optimizer_cls`` from a Megatron-LM ``OptimizerConfig``.

    Megatron-LM's rule: argument ``<name>`` takes ``config.<prefix>_<name>`` (a later prefix winning),
    else ``config.<name>``. Every config field starting with one of ``prefixes`` + "_" must map to an
    argument (directly, or through :data:`RENAMED_CONFIG_FIELDS`), be in
    :data:`CONSUMED_CONFIG_FIELDS`, or pass ``tolerated``; any other raises
    :class:`UnknownConfigFieldError` (a ValueError) naming the field and the megatron-core version.
    ``arguments`` replaces the constructor's own argument names (a class taking ``**kwargs``).
    """
    if arguments is None:
        arguments = [n for n, p in inspect.signature(optimizer_cls).parameters.items()
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    accepted = [n for n in arguments if n not in _DERIVED_ARGUMENTS]
    kwargs: dict[str, Any] = {}
    for name in accepted:  # Megatron-LM's direction: each argument looks for its field
        for prefix in reversed(prefixes):
            if hasattr(config, f"{prefix}_{name}"):
                kwargs[name] = getattr(config, f"{prefix}_{name}")
                break
        else:
            if hasattr(config, name):
                kwargs[name] = getattr(config, name)
    unknown = []
    for field_name in _config_field_names(config):  # ours also: each field must find its argument
        stripped = [field_name[len(p) + 1:] for p in prefixes if field_name.startswith(p + "_")]
        if not stripped or any(s in accepted for s in stripped) or field_name in CONSUMED_CONFIG_FIELDS:
            continue
        renamed = RENAMED_CONFIG_FIELDS.get(field_name)
        if renamed is not None and renamed in accepted:
            if not any(hasattr(config, f"{p}_{renamed}") for p in prefixes):
                kwargs[renamed] = getattr(config, field_name)
            continue
        if tolerated is not None and tolerated(field_name):
            continue
        unknown.append(field_name)
    if unknown:
        what = f"optimizer {entry_name!r} ({optimizer_cls.__name__})" if entry_name else optimizer_cls.__name__
        described = ", ".join(f"{f!r} (argument {_strip_prefix(f, prefixes)!r})" for f in unknown)
        raise UnknownConfigFieldError(
            f"OptimizerConfig field{'s' if len(unknown) > 1 else ''} {described} of {_megatron_core_label()}: "
            f"{what} has no such constructor argument and megatron-eopt does not read the field otherwise "
            f"(fields read: {', '.join(p + '_*' for p in prefixes)}); remove it from the config or use a "
            "megatron-eopt release that supports it"
        )
    return kwargs


def qkv_split_shapes_from_model_config(model_config: Any, per_head: bool = False) -> list[int]:
    """Rows of one query group of a fused QKV weight: [q, k, v] or [q, gate, k, v]; with ``per_head``
    (Megatron-LM PR #6326's ``split_qkv_per_head``) the rows of every head of the whole matrix, in order.

    Megatron-LM interleaves the projections per query group; q spans
    heads/groups · kv_channels rows, k and v kv_channels each.
    """
    heads = model_config.num_attention_heads
    groups = model_config.num_query_groups or heads
    kv = model_config.kv_channels
    gated = getattr(model_config, "attention_output_gate", False)
    if per_head:
        per_group = heads // groups
        return ([kv] * per_group * (2 if gated else 1) + [kv, kv]) * groups
    q = heads // groups * kv
    if gated:
        return [q, q, kv, kv]
    return [q, kv, kv]


# Options of Megatron-LM's Muon that megatron-core 0.19 has not: OptimizerConfig field -> (constructor
# argument, what it is). Where the config's own class does not declare the field, that megatron-core's
# factory does not tag the parameters the option splits, so a request for it set on the config stops
# the build (naming the version) instead of running what that megatron-core does not.
NEWER_CONFIG_FIELDS: dict[str, tuple[str, str]] = {
    "muon_split_glu": ("split_glu", "gate and up of a gated linear_fc1 apart, Megatron-LM PR #6688"),
    "muon_split_qkv_per_head": ("split_qkv_per_head", "every QKV head apart, Megatron-LM PR #6326 / #7085"),
}


def check_newer_config_fields(config: Any) -> None:
    """ValueError naming the field and the megatron-core version when ``config`` (a Megatron-LM
    ``OptimizerConfig``, a dataclass) asks for an option of :data:`NEWER_CONFIG_FIELDS` its class does
    not declare (set as an attribute, to a value other than False)."""
    import dataclasses

    if not dataclasses.is_dataclass(config):
        return
    declared = {f.name for f in dataclasses.fields(config)}
    for field_name, (argument, what) in NEWER_CONFIG_FIELDS.items():
        value = getattr(config, field_name, False)
        if field_name not in declared and value is not False:
            raise ValueError(
                f"OptimizerConfig.{field_name}={value!r} ({what}): {_megatron_core_label()} has no such option; its "
                f"{type(config).__name__} does not declare the field, and its factory does not tag the parameters "
                f"the option splits. Leave the field unset (as this megatron-core runs), use a megatron-core that "
                f"has it, or pass {argument}= to the optimizer class yourself with the parameters tagged"
            )


def _is_tagged_qkv(param: torch.Tensor) -> bool:
    # Megatron's factory tags fused QKV weights (and their split shapes) before building.
    return bool(getattr(param, "is_qkv", False))


def muon_config_to_kwargs(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
    """Megatron-LM ``OptimizerConfig`` → :class:`TensorParallelMuon` keyword arguments (every
    ``muon_*`` field; see :func:`config_kwargs`)."""
    from .optim import TensorParallelMuon

    check_newer_config_fields(config)
    return _with_model_and_groups(config_kwargs(TensorParallelMuon, config, ("muon",), entry_name="muon"),
                                  model_chunks, pg_collection)


def adaptive_muon_config_to_kwargs(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
    """Megatron-LM ``OptimizerConfig`` → :class:`TensorParallelAdaptiveMuon` keyword arguments (every
    ``muon_*`` and ``adaptive_muon_*`` field, the latter winning; see :func:`config_kwargs`)."""
    from .optim import TensorParallelAdaptiveMuon

    check_newer_config_fields(config)
    kwargs = config_kwargs(TensorParallelAdaptiveMuon, config, ("muon", "adaptive_muon"), entry_name="adaptive_muon")
    return _with_model_and_groups(kwargs, model_chunks, pg_collection)


def _with_model_and_groups(kwargs: dict[str, Any], model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
    """``kwargs`` plus what Megatron-LM's entries derive: the QKV test and split, the process groups."""
    kwargs["is_qkv_fn"] = _is_tagged_qkv
    model_config = getattr(model_chunks[0], "config", None) if model_chunks else None
    per_head = bool(kwargs.get("split_qkv_per_head"))
    kwargs["qkv_split_shapes"] = (
        qkv_split_shapes_from_model_config(model_config, per_head) if model_config is not None else None
    )
    if model_config is None:
        kwargs["split_qkv"] = False  # nothing to split by without the model's head layout
    kwargs["pg_collection"] = pg_collection
    return kwargs


# Megatron-LM's muon_ht fields (PR #6422: --muon-ht-radius, --muon-ht-eps, on the optimizer's config
# or the model's TransformerConfig) and the constructor arguments they reach.
MUON_HT_FIELDS = {"muon_ht_radius": "hyperball_radius", "muon_ht_eps": "hyperball_eps"}


def muon_ht_config_to_kwargs(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
    """Megatron-LM ``OptimizerConfig`` → :class:`~megatron_eopt.optim.TensorParallelMuonHT` keyword
    arguments: those of "muon" (every ``muon_*`` field), and ``muon_ht_radius`` / ``muon_ht_eps`` from
    the optimizer's config, else from the model's config. ``weight_decay`` comes from the config as for
    "muon": the class refuses anything but 0."""
    from .optim import TensorParallelMuon, TensorParallelMuonHT

    check_newer_config_fields(config)
    arguments = list(inspect.signature(TensorParallelMuon).parameters) + list(MUON_HT_FIELDS.values())
    kwargs = config_kwargs(TensorParallelMuonHT, config, ("muon",), tolerated=lambda f: f in MUON_HT_FIELDS,
                           entry_name="muon_ht", arguments=arguments)
    model_config = getattr(model_chunks[0], "config", None) if model_chunks else None
    for field_name, argument in MUON_HT_FIELDS.items():
        for source in (config, model_config):
            if source is not None and getattr(source, field_name, None) is not None:
                kwargs[argument] = getattr(source, field_name)
                break
    return _with_model_and_groups(kwargs, model_chunks, pg_collection)


def _sharding_groups(pg_collection: Any) -> list[str]:
    """The names of ``pg_collection``'s tensor-parallel / GTP groups of more than one rank."""
    import torch.distributed as dist

    names = []
    for name in ("tp", "expt_tp", "gtp_remat", "expt_gtp_remat"):
        group = getattr(pg_collection, name, None) if pg_collection is not None else None
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            names.append(name)
    return names


def _tensor_parallel_muon_option(field_name: str) -> bool:
    """Whether ``field_name`` is ``muon_<argument of TensorParallelMuon>`` (or an older spelling of one)."""
    from .optim import TensorParallelMuon

    return field_name.startswith("muon_") and (
        field_name[len("muon_"):] in inspect.signature(TensorParallelMuon).parameters
        or field_name in RENAMED_CONFIG_FIELDS
    )


def family_config_to_kwargs(optimizer_cls: type, name: str | None = None) -> Callable[[Any, Any, Any], dict[str, Any]]:
    """Megatron-LM ``OptimizerConfig`` → keyword arguments of an EO 0.4 family class registered as
    ``name``: its ``<name>_*`` fields (Megatron-LM's prefix for such entries) and the ``muon_*`` fields
    its constructor takes (and lr, weight_decay). A ``muon_*`` option of Megatron-LM's Muon the class
    has no use for (``muon_split_qkv``, ``muon_tp_mode``...) is left out; any other unknown field of
    either prefix raises. MuonHyperball also needs ``config.muon_hyperball_radius`` (Megatron-LM has no
    such field: set it on the config)."""
    prefixes = ("muon",) if name is None or name == "muon" else ("muon", name)

    def config_to_kwargs(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
        arguments = None
        if optimizer_cls.__name__ == "MuonHyperball":  # Muon's arguments (through **kwargs) and its own
            arguments = [n for n, p in inspect.signature(optimizer_cls).parameters.items() if p.kind == p.KEYWORD_ONLY]
            arguments += list(inspect.signature(_muon_cls()).parameters)
        kwargs = config_kwargs(optimizer_cls, config, prefixes, tolerated=_tensor_parallel_muon_option,
                               entry_name=name, arguments=arguments)
        if optimizer_cls.__name__ == "MuonHyperball":
            if kwargs.get("hyperball_radius") is None:
                raise ValueError("muon_hyperball needs config.muon_hyperball_radius (the weights' Frobenius norm)")
            sharding = _sharding_groups(pg_collection)
            if sharding:  # its norms (and Newton–Schulz) would be each shard's, not the matrix's
                raise ValueError(
                    f"muon_hyperball takes the norms of each rank's shard, and pg_collection shards the weights over "
                    f"{', '.join(sharding)}: use optimizer='muon_ht' (TensorParallelMuonHT), whose norms are the "
                    "whole matrices'")
        return kwargs

    return config_to_kwargs


def _muon_cls() -> type:
    from .optim import Muon

    return Muon


# ------------------------------------------------------------------ the registry
_ENTRIES: dict[str, EmergingOptimizerEntry] = {}
_LOCK = threading.Lock()
_BUILTINS_LOADED = False


def _load_builtins() -> None:
    # Deferred: the optimizer classes load the compiled library, the registry itself does not.
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    with _LOCK:
        if _BUILTINS_LOADED:
            return
        from . import optim

        # The per-group values of the tensor-parallel classes: the rest is optimizer-wide.
        muon_groups, adaptive_groups = ("lr", "momentum", "weight_decay"), ("lr", "momentum", "weight_decay", "beta2", "eps")
        builtins = {
            "muon": EmergingOptimizerEntry(
                optim.TensorParallelMuon, config_to_kwargs=muon_config_to_kwargs,
                constructor_only_kwargs=constructor_only_arguments(optim.TensorParallelMuon, muon_groups),
            ),
            "adaptive_muon": EmergingOptimizerEntry(
                optim.TensorParallelAdaptiveMuon, config_to_kwargs=adaptive_muon_config_to_kwargs,
                constructor_only_kwargs=constructor_only_arguments(optim.TensorParallelAdaptiveMuon, adaptive_groups),
            ),
        }
        builtins["muon_ht"] = EmergingOptimizerEntry(
            optim.TensorParallelMuonHT, config_to_kwargs=muon_ht_config_to_kwargs,
            constructor_only_kwargs=constructor_only_arguments(optim.TensorParallelMuon, muon_groups)
            | {"hyperball_radius", "hyperball_eps"},
        )
        for name, cls in (("scion", optim.Scion), ("mop", optim.MOP), ("polargrad", optim.PolarGrad),
                          ("spel", optim.Spel), ("muown", optim.Muown), ("muon_hyperball", optim.MuonHyperball)):
            builtins[name] = EmergingOptimizerEntry(cls, config_to_kwargs=family_config_to_kwargs(cls, name))
        for name, entry in builtins.items():
            _ENTRIES.setdefault(name, entry)  # a user registration made earlier wins
        _BUILTINS_LOADED = True


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name in ("adam", "sgd"):
        raise ValueError(f"name {name!r} is reserved for Megatron-LM's standard optimizers")
    return name


def register(name: str, entry: EmergingOptimizerEntry, *, replace: bool = False) -> None:
    """Adds ``entry`` under ``name``; an existing name needs ``replace=True``."""
    _check_name(name)
    if not isinstance(entry, EmergingOptimizerEntry):
        raise TypeError(f"entry must be an EmergingOptimizerEntry, got {type(entry).__name__}")
    if not (isinstance(entry.optimizer_cls, type) and issubclass(entry.optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"entry.optimizer_cls must be a torch.optim.Optimizer subclass, got {entry.optimizer_cls!r}")
    if not callable(entry.init_state_fn):
        raise TypeError("entry.init_state_fn must be callable")
    if entry.config_to_kwargs is not None and not callable(entry.config_to_kwargs):
        raise TypeError("entry.config_to_kwargs must be callable or None")
    _load_builtins()
    with _LOCK:
        if name in _ENTRIES and not replace:
            raise ValueError(f"an optimizer entry named {name!r} is already registered (pass replace=True)")
        _ENTRIES[name] = entry


def get(name: str) -> EmergingOptimizerEntry:
    """The entry registered under ``name``; KeyError listing the known names otherwise."""
    _load_builtins()
    try:
        return _ENTRIES[name]
    except KeyError:
        raise KeyError(f"no optimizer entry named {name!r}; registered: {sorted(_ENTRIES)}") from None


def names() -> list[str]:
    """Registered names, sorted."""
    _load_builtins()
    return sorted(_ENTRIES)


# ------------------------------------------------------------------ Emerging-Optimizers' class registry
# EO's functions, same names, arguments and errors; names are case-insensitive. Our classes are
# registered under EO 0.4's names (EO's contrib Muown is not registered there, nor here).
_OPTIMIZERS: dict[str, type] = {}
_EO_BUILTINS_LOADED = False


def _load_eo_builtins() -> None:
    global _EO_BUILTINS_LOADED
    if _EO_BUILTINS_LOADED:
        return
    from . import optim

    with _LOCK:
        for name, cls in (("muon", optim.Muon), ("adaptive_muon", optim.AdaptiveMuon), ("scion", optim.Scion),
                          ("mop", optim.MOP), ("muon_hyperball", optim.MuonHyperball),
                          ("polargrad", optim.PolarGrad), ("spel", optim.Spel)):
            _OPTIMIZERS.setdefault(name, cls)
        _EO_BUILTINS_LOADED = True


def register_optimizer(name: str) -> Callable[[type], type]:
    """Class decorator: registers the optimizer class under ``name`` (ValueError if taken)."""

    def decorator(cls: type) -> type:
        _load_eo_builtins()
        with _LOCK:
            if name.lower() in _OPTIMIZERS:
                raise ValueError(f"Optimizer {name} already registered.")
            _OPTIMIZERS[name.lower()] = cls
        return cls

    return decorator


def get_optimizer_name_list() -> list[str]:
    """Names in EO's class registry."""
    _load_eo_builtins()
    return list(_OPTIMIZERS)


def get_optimizer_cls(name: str) -> type:
    """The class registered under ``name``; ValueError when there is none."""
    _load_eo_builtins()
    cls = _OPTIMIZERS.get(name.lower())
    if cls is None:
        raise ValueError(f"Optimizer {name} not found in the registry.")
    return cls


def validate_optimizer_args(opt_cls: type, kwargs: dict[str, Any]) -> None:
    """TypeError naming the keyword arguments ``opt_cls``'s constructor does not take (``params`` aside)."""
    supported = set(inspect.signature(opt_cls).parameters)
    unknown = set(kwargs) - supported - {"params"}
    if unknown:
        raise TypeError(
            f"Optimizer '{opt_cls.__name__}' does not accept arguments: {unknown}.\n"
            f"Valid options are: {list(supported)}"
        )


def get_configured_optimizer_cls(name: str, **kwargs: Any) -> Callable[..., torch.optim.Optimizer]:
    """``params -> optimizer``: the class registered under ``name`` with ``kwargs`` bound (checked first)."""
    cls = get_optimizer_cls(name)
    validate_optimizer_args(cls, kwargs)
    return partial(cls, **kwargs)
