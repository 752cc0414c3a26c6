"""Registry of optimizer entries: what a trainer needs to build and checkpoint each optimizer.

An :class:`EmergingOptimizerEntry` carries the optimizer class, a function that creates every
state tensor up front (checkpoint formats need the state before the first step), a function
mapping a Megatron-LM ``OptimizerConfig`` to constructor arguments, and per-parameter overrides
(by default: non-matrix, embedding/output and ``use_muon = False`` parameters go to Adam). The
entries have the same fields as Megatron-LM's registry, so :mod:`megatron_eopt.integrations.megatron`
can put them into ``megatron.core.optimizer``; nothing here imports megatron-core.

Built-in entries: ``"muon"`` (:class:`~megatron_eopt.optim.TensorParallelMuon`),
``"adaptive_muon"`` (:class:`~megatron_eopt.optim.TensorParallelAdaptiveMuon`), and the rest of
Emerging-Optimizers 0.4's family: ``"scion"``, ``"mop"``, ``"polargrad"``, ``"spel"``, ``"muown"``,
``"muon_hyperball"`` (its radius from the config's ``muon_hyperball_radius``).

Emerging-Optimizers' own class registry is here too: :func:`register_optimizer`,
:func:`get_optimizer_cls`, :func:`get_optimizer_name_list`, :func:`validate_optimizer_args`,
:func:`get_configured_optimizer_cls`, with megatron-eopt's classes under EO's names.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

__all__ = [
    "EmergingOptimizerEntry",
    "ParamRule",
    "get",
    "get_configured_optimizer_cls",
    "get_optimizer_cls",
    "get_optimizer_name_list",
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
    """

    optimizer_cls: type
    init_state_fn: Callable[..., None] = init_optimizer_state
    config_to_kwargs: Callable[[Any, Any, Any], dict[str, Any]] | None = None
    default_param_overrides: dict[Any, dict[str, Any]] = field(default_factory=_route_nonlinear_to_adam)


# ------------------------------------------------------------------ Megatron config mapping
# (constructor argument, OptimizerConfig field). Only fields the config has are used, so older
# configs fall back to the class defaults. Megatron-LM maps the same fields by name; like it,
# weight decay is always decoupled (OptimizerConfig.decoupled_weight_decay is Adam's switch).
_MUON_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("lr", "lr"),
    ("momentum", "muon_momentum"),
    ("nesterov", "muon_nesterov"),
    ("weight_decay", "weight_decay"),
    ("split_qkv", "muon_split_qkv"),
    ("fp32_matmul_prec", "muon_fp32_matmul_prec"),
    ("coefficient_type", "muon_coefficient_type"),
    ("num_ns_steps", "muon_num_ns_steps"),
    ("scale_mode", "muon_scale_mode"),
    ("extra_scale_factor", "muon_extra_scale_factor"),
    ("tp_mode", "muon_tp_mode"),
    ("use_syrk", "muon_use_syrk"),  # Megatron-LM main: symmetric products
    # Megatron-LM's layer-sharded Muon (--muon-ns-batch-size, --muon-expert-tp-mode)
    ("ns_batch_size", "muon_ns_batch_size"),
    ("expert_tp_mode", "muon_expert_tp_mode"),
)
_ADAPTIVE_MUON_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("moment2_method", "adaptive_muon_moment2_method"),
    ("beta2", "adaptive_muon_beta2"),
    ("eps", "adaptive_muon_eps"),
)


def qkv_split_shapes_from_model_config(model_config: Any) -> list[int]:
    """Rows of one query group of a fused QKV weight: [q, k, v] or [q, gate, k, v].

    Megatron-LM interleaves the projections per query group; q spans
    heads/groups · kv_channels rows, k and v kv_channels each.
    """
    heads = model_config.num_attention_heads
    groups = model_config.num_query_groups or heads
    kv = model_config.kv_channels
    q = heads // groups * kv
    if getattr(model_config, "attention_output_gate", False):
        return [q, q, kv, kv]
    return [q, kv, kv]


def _is_tagged_qkv(param: torch.Tensor) -> bool:
    # Megatron's factory tags fused QKV weights (and their split shapes) before building.
    return bool(getattr(param, "is_qkv", False))


def _fields_from_config(config: Any, table: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    return {kwarg: getattr(config, name) for kwarg, name in table if hasattr(config, name)}


def muon_config_to_kwargs(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
    """Megatron-LM ``OptimizerConfig`` → :class:`TensorParallelMuon` keyword arguments."""
    kwargs = _fields_from_config(config, _MUON_CONFIG_FIELDS)
    kwargs["is_qkv_fn"] = _is_tagged_qkv
    model_config = getattr(model_chunks[0], "config", None) if model_chunks else None
    kwargs["qkv_split_shapes"] = (
        qkv_split_shapes_from_model_config(model_config) if model_config is not None else None
    )
    if model_config is None:
        kwargs["split_qkv"] = False  # nothing to split by without the model's head layout
    kwargs["pg_collection"] = pg_collection
    return kwargs


def adaptive_muon_config_to_kwargs(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
    """Megatron-LM ``OptimizerConfig`` → :class:`TensorParallelAdaptiveMuon` keyword arguments."""
    kwargs = muon_config_to_kwargs(config, model_chunks, pg_collection)
    kwargs.update(_fields_from_config(config, _ADAPTIVE_MUON_CONFIG_FIELDS))
    return kwargs


def family_config_to_kwargs(optimizer_cls: type) -> Callable[[Any, Any, Any], dict[str, Any]]:
    """Megatron-LM ``OptimizerConfig`` → keyword arguments of an EO 0.4 family class: the ``muon_*``
    fields (and lr, weight_decay) its constructor takes. MuonHyperball also needs
    ``config.muon_hyperball_radius`` (Megatron-LM has no such field: set it on the config)."""
    accepted = set(inspect.signature(optimizer_cls).parameters)

    def config_to_kwargs(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
        kwargs = {k: v for k, v in _fields_from_config(config, _MUON_CONFIG_FIELDS).items() if k in accepted}
        if optimizer_cls.__name__ == "MuonHyperball":
            radius = getattr(config, "muon_hyperball_radius", None)
            if radius is None:
                raise ValueError("muon_hyperball needs config.muon_hyperball_radius (the weights' Frobenius norm)")
            kwargs.update({k: v for k, v in _fields_from_config(config, _MUON_CONFIG_FIELDS).items()
                           if k in inspect.signature(_muon_cls()).parameters}, hyperball_radius=radius)
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

        builtins = {
            "muon": EmergingOptimizerEntry(optim.TensorParallelMuon, config_to_kwargs=muon_config_to_kwargs),
            "adaptive_muon": EmergingOptimizerEntry(
                optim.TensorParallelAdaptiveMuon, config_to_kwargs=adaptive_muon_config_to_kwargs
            ),
        }
        for name, cls in (("scion", optim.Scion), ("mop", optim.MOP), ("polargrad", optim.PolarGrad),
                          ("spel", optim.Spel), ("muown", optim.Muown), ("muon_hyperball", optim.MuonHyperball)):
            builtins[name] = EmergingOptimizerEntry(cls, config_to_kwargs=family_config_to_kwargs(cls))
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
