"""Plug megatron-eopt's optimizers into Megatron-LM's optimizer factory.

After :func:`install`, ``megatron.core.optimizer.get_megatron_optimizer`` with
``OptimizerConfig(optimizer="muon")`` (or ``"adaptive_muon"``, or any name registered in
:mod:`megatron_eopt.registry`) builds megatron-eopt's classes from the usual ``muon_*`` /
``adaptive_muon_*`` config fields, each reaching the constructor argument of its name; a field of
that prefix which neither the constructor nor megatron-eopt knows stops the build with a ValueError
naming it (:func:`megatron_eopt.registry.config_kwargs`). Megatron's own parameter routing stays in charge: its factory
tags fused QKV weights, applies the entry's ``default_param_overrides`` and wraps the result in
its mixed-precision / chained / layer-wise optimizers. For a name Megatron-LM registers itself
("muon", "adaptive_muon") and an entry with the built-in routing rule, the installed entry keeps
Megatron-LM's own overrides (its ``_is_nonlinear_or_embedding`` in 0.18/0.19, its
``_is_muon_excluded`` in later releases), so whatever Megatron-LM sends to the scalar optimizer
(Adam, or Lion via ``muon_scalar_optimizer``) goes there; a parameter marked ``use_muon = False``
goes there too, also with a megatron-core that does not know that flag yet.

``install(replace_classes=True)`` also binds Megatron-LM's module-level names
``megatron.core.optimizer.emerging_optimizers.TensorParallelMuon`` /
``TensorParallelAdaptiveMuon`` to megatron-eopt's classes, for code that builds them by name.

Works with megatron-core >= 0.18 (the release that introduced the emerging-optimizer registry)
whether or not the ``emerging-optimizers`` package is installed: Megatron-LM refuses its
emerging-optimizer path without that package; our entries do not need it, so :func:`install`
lifts that check (and :func:`uninstall` puts it back).

Beside this module: ``megatron_clipping`` (the chained optimizers' clip), ``megatron_fsdp2``
(Torch-FSDP2: the training script's argument check, the checkpoint guard), ``megatron_legacy``
(Megatron-LM's older ``muon.py`` factory) and ``_megatron_patches`` (what install() changed in
Megatron-LM's modules, for uninstall()).

Usage::

    from megatron_eopt.integrations import megatron as eopt_megatron
    eopt_megatron.install()
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=..., ...), model)
"""

from __future__ import annotations

import importlib
import inspect
import sys
import threading
from typing import Any

import torch

from .. import registry
from .._megatron_version import megatron_core_version
from . import megatron_clipping, megatron_overlap
from ._megatron_patches import installed, is_ours, restore_globals, set_global
from .megatron_fsdp_v2 import guard_fsdp_muon
from .megatron_fsdp2 import FSDP2_CKPT_FORMAT, allow_torch_fsdp2, guard_torch_dist_under_fsdp2  # noqa: F401 (re-exported)

__all__ = [
    "MIN_MEGATRON_CORE",
    "allow_torch_fsdp2",
    "classes_replaced",
    "install",
    "installed",
    "megatron_core_version",
    "uninstall",
]

MIN_MEGATRON_CORE = (0, 18)

_LOCK = threading.Lock()
# name -> the Megatron entry ours replaced (None where the name was new); filled by install().
_REPLACED: dict[str, Any] = {}
# Megatron module globals changed by install(), with their previous values, for uninstall().


class _LionNeedsEmergingOptimizers:
    """Stands in for ``emerging_optimizers.Lion`` in Megatron when that package is missing.

    install() lets Megatron's emerging-optimizer path run without Emerging-Optimizers; this
    keeps ``muon_scalar_optimizer="lion"`` failing with the clear message Megatron would give.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError(
            "the Lion optimizer (muon_scalar_optimizer='lion' or optimizer='lion') needs the "
            "emerging-optimizers package: pip install emerging-optimizers"
        )


def _megatron_modules() -> tuple[Any, Any]:
    """(megatron.core.optimizer, megatron.core.optimizer.emerging_optimizers), checked."""
    version = megatron_core_version()
    need = ".".join(map(str, MIN_MEGATRON_CORE))
    if version is not None and version < MIN_MEGATRON_CORE:
        raise ImportError(
            f"megatron-eopt needs megatron-core >= {need} (its emerging-optimizer registry); "
            f"found {'.'.join(map(str, version))}. Upgrade with: pip install -U megatron-core"
        )
    try:
        factory = importlib.import_module("megatron.core.optimizer")
        emerging = importlib.import_module("megatron.core.optimizer.emerging_optimizers")
    except ImportError as exc:
        hint = ""
        if "override" in str(exc) and sys.version_info < (3, 12):
            hint = (
                " (emerging-optimizers needs Python >= 3.12 for typing.override; on older Python "
                "set typing.override = typing_extensions.override before importing megatron, or "
                "uninstall emerging-optimizers: megatron-eopt does not need it)"
            )
        raise ImportError(
            f"megatron-eopt's Megatron-LM integration needs megatron-core >= {need} "
            f"(pip install megatron-core); importing it failed: {exc}{hint}"
        ) from exc
    missing = [n for n in ("_EMERGING_OPTIMIZERS", "EmergingOptimizerEntry") if not hasattr(emerging, n)]
    missing += [n for n in ("get_megatron_optimizer",) if not hasattr(factory, n)]
    if missing:
        raise ImportError(
            f"this megatron-core has no emerging-optimizer registry (missing {', '.join(missing)}); "
            f"megatron-eopt needs megatron-core >= {need}"
        )
    return factory, emerging


def _to_megatron_overrides(overrides: dict[Any, dict[str, Any]], optimizer_config: Any) -> dict[Any, dict[str, Any]]:
    """Our ParamRule keys → Megatron ParamKey(predicate=ParamPredicate); other keys pass through."""
    ParamKey = optimizer_config.ParamKey
    ParamPredicate = optimizer_config.ParamPredicate
    converted = {}
    for key, value in overrides.items():
        if isinstance(key, registry.ParamRule):
            key = ParamKey(predicate=ParamPredicate(name=key.name, fn=key.fn))
        converted[key] = dict(value)
    return converted


def _use_muon_false(param: Any) -> bool:
    return getattr(param, "use_muon", True) is False


def _megatron_routing(stock: Any, optimizer_config: Any) -> dict[Any, dict[str, Any]]:
    """Megatron-LM's own overrides of ``stock`` (its registry entry), plus ``use_muon = False``.

    The ParamKeys are Megatron's own (same predicates, looked up in Megatron's module), so the
    routing is exactly Megatron's. A megatron-core whose rule ignores ``use_muon`` (0.18, 0.19)
    gets one more key sending such parameters to the same scalar optimizer.
    """
    overrides = {key: dict(value) for key, value in stock.default_param_overrides.items()}
    probe = torch.nn.Parameter(torch.zeros(2, 2))
    probe.use_muon = False
    honoured = any(key.matches(probe, "") for key, value in overrides.items() if "optimizer" in value)
    if not honoured:
        scalar = next((v["optimizer"] for v in overrides.values() if "optimizer" in v), "adam")
        key = optimizer_config.ParamKey(
            predicate=optimizer_config.ParamPredicate(name="use_muon_false", fn=_use_muon_false)
        )
        overrides[key] = {"optimizer": scalar}
    return overrides


# megatron-core's rule for which parameters its layer-wise distributed optimizer owns (and so which
# DDP buffer, layer-wise or DistributedOptimizer, holds them); 0.18 / 0.19 have it in this module.
_LAYER_WISE_MODULE = "megatron.core.optimizer.layer_wise_optimizer"
_LAYER_WISE_RULE = "is_managed_by_layer_wise_optimizer"


def _layer_wise_rule_honouring_use_muon(rule: Any) -> Any:
    """``rule``, except that a parameter marked ``use_muon = False`` is not the layer-wise optimizer's."""

    def is_managed_by_layer_wise_optimizer(param: torch.nn.Parameter) -> bool:
        return not _use_muon_false(param) and rule(param)

    is_managed_by_layer_wise_optimizer._megatron_eopt = True
    is_managed_by_layer_wise_optimizer.__doc__ = rule.__doc__
    return is_managed_by_layer_wise_optimizer


def _align_layer_wise_ownership(factory: Any) -> None:
    """Makes Megatron's layer-wise ownership rule agree with the routing of ``use_muon = False``.

    A megatron-core whose rule ignores the flag (0.18, 0.19) puts such a 2-D weight in the
    layer-wise DDP buffer while our routing sends it to the scalar optimizer; with
    ``use_distributed_optimizer=True`` that optimizer is a DistributedOptimizer, which updates
    only the other buffers, so the weight would silently never train. Later megatron-core
    releases exclude ``use_muon = False`` themselves, as this does. Applies to models wrapped in
    DDP after install().
    """
    try:
        layer_wise = importlib.import_module(_LAYER_WISE_MODULE)
    except ImportError:
        return
    rule = getattr(layer_wise, _LAYER_WISE_RULE, None)
    if rule is None or getattr(rule, "_megatron_eopt", False):
        return
    probe = torch.nn.Parameter(torch.zeros(2, 2))
    probe.use_muon = False
    if not rule(probe):
        return  # this megatron-core already honours use_muon
    aligned = _layer_wise_rule_honouring_use_muon(rule)
    set_global(layer_wise, _LAYER_WISE_RULE, aligned)
    if getattr(factory, _LAYER_WISE_RULE, None) is rule:
        set_global(factory, _LAYER_WISE_RULE, aligned)


# The step's memory options install() sets for the optimizers its entries build: a key absent means
# the class default. A Megatron config attribute of the same meaning (STEP_OPTION_FIELDS) wins.
_STEP_OPTIONS: dict[str, Any] = {}
_UNSET = object()

# (constructor argument, OptimizerConfig attribute): not fields of Megatron-LM's config, set them on
# it (``config.muon_workspace_mib = 512``) to choose per optimizer build.
STEP_OPTION_FIELDS: tuple[tuple[str, str], ...] = (
    ("state_dtype", "muon_state_dtype"),
    ("state_block_size", "muon_state_block_size"),
    ("workspace_mib", "muon_workspace_mib"),
    ("overlap_backward", "muon_overlap_backward"),
)


def _with_step_options(optimizer_cls: type, config_to_kwargs: Any) -> Any:
    """``config_to_kwargs`` plus the step options for the constructor arguments ``optimizer_cls`` takes."""
    accepted = set(inspect.signature(optimizer_cls).parameters)

    def with_step_options(config: Any, model_chunks: Any, pg_collection: Any) -> dict[str, Any]:
        kwargs = dict(config_to_kwargs(config, model_chunks, pg_collection)) if config_to_kwargs is not None else {}
        for kwarg, field in STEP_OPTION_FIELDS:
            if kwarg not in accepted:
                continue
            if hasattr(config, field):
                kwargs[kwarg] = getattr(config, field)
            elif kwarg in _STEP_OPTIONS:
                kwargs[kwarg] = _STEP_OPTIONS[kwarg]
        if kwargs.get("overlap_backward"):
            _overlap_with_megatron_ddp(model_chunks, config)
        return kwargs

    return with_step_options


def _overlap_with_megatron_ddp(model_chunks: Any, config: Any) -> None:
    """``overlap_backward`` for an optimizer built over ``model_chunks``: Megatron DDP's bucket groups
    report their reduced gradients (:mod:`.megatron_overlap`); torch FSDP2's wrapper needs nothing.
    Any other wrapper (Megatron-FSDP) is refused, naming it, and so are fp16 (its loss scale is
    unscaled from the gradients in step()) and a clip policy that clips Muon's gradients ("global",
    "separate": the clip would scale gradients whose Newton–Schulz already started)."""
    if getattr(config, "fp16", False):
        raise ValueError("overlap_backward with fp16: Megatron-LM unscales the loss-scaled gradients in step(), after "
                         "backward started their Newton–Schulz; use bf16, or overlap_backward=False")
    chosen = megatron_clipping.policy(config)
    if chosen != "adamw" and (getattr(config, "clip_grad", 0.0) or 0.0) > 0.0:
        raise ValueError(
            f"overlap_backward with clip_policy {chosen!r} and clip_grad={config.clip_grad}: the clip would scale "
            "Muon's gradients after backward started their Newton–Schulz; use clip_policy 'adamw' (the default: "
            "Muon's gradients are not clipped) or clip_grad=0")
    if model_chunks is None:
        raise ValueError("overlap_backward under Megatron-LM needs the model chunks the optimizer is built for "
                         "(get_megatron_optimizer's model_chunks); got None")
    for chunk in model_chunks:
        if not megatron_overlap.is_megatron_ddp(chunk) and not _is_torch_fsdp2(chunk):
            raise ValueError(
                f"overlap_backward under Megatron-LM works with its DistributedDataParallel and torch FSDP2 "
                f"(--use-torch-fsdp2); the model chunk is a {type(chunk).__name__}: build the optimizer with "
                "muon_overlap_backward = False")
    megatron_overlap.attach(model_chunks)


def _is_torch_fsdp2(chunk: Any) -> bool:
    return any(t.__name__ == "TorchFullyShardedDataParallel" for t in type(chunk).__mro__)


def _to_megatron_entry(
    entry: registry.EmergingOptimizerEntry, emerging: Any, optimizer_config: Any, stock: Any = None
) -> Any:
    megatrons_routing = stock is not None and not is_ours(stock) and registry.uses_default_routing(entry)
    if megatrons_routing:
        overrides = _megatron_routing(stock, optimizer_config)
    else:
        overrides = _to_megatron_overrides(entry.default_param_overrides, optimizer_config)
    extra = {}
    if "config_to_cls" in getattr(emerging.EmergingOptimizerEntry, "__dataclass_fields__", {}):
        # Megatron-LM's layer-sharded Muon picks a class per tp mode (config_to_cls); ours runs every
        # mode (tp_mode, expert_tp_mode, ns_batch_size) itself, so the entry's class is the answer.
        extra["config_to_cls"] = _always(entry.optimizer_cls)
    if "constructor_only_kwargs" in getattr(emerging.EmergingOptimizerEntry, "__dataclass_fields__", {}):
        # Megatron-LM's optimizer recipes (#5925) refuse these per parameter group.
        extra["constructor_only_kwargs"] = frozenset(entry.constructor_only_kwargs)
    megatron_entry = emerging.EmergingOptimizerEntry(
        optimizer_cls=entry.optimizer_cls,
        init_state_fn=entry.init_state_fn,
        config_to_kwargs=_with_step_options(entry.optimizer_cls, entry.config_to_kwargs),
        default_param_overrides=overrides,
        **extra,
    )
    megatron_entry._megatrons_routing = megatrons_routing
    return megatron_entry


def _always(optimizer_cls: type):
    def config_to_cls(*args: Any, **kwargs: Any) -> type:
        return optimizer_cls

    return config_to_cls


# Megatron-LM's module-level class names install(replace_classes=True) binds, and our classes.
_CLASS_NAMES = ("TensorParallelMuon", "TensorParallelAdaptiveMuon")


def _bind_classes(emerging: Any) -> None:
    """Binds Megatron's TensorParallelMuon / TensorParallelAdaptiveMuon names to ours (once)."""
    from .. import optim

    for name in _CLASS_NAMES:
        ours = getattr(optim, name)
        if getattr(emerging, name, None) is not ours:
            set_global(emerging, name, ours)


def classes_replaced() -> bool:
    """Whether Megatron-LM's TensorParallelMuon / TensorParallelAdaptiveMuon names are ours."""
    emerging = sys.modules.get("megatron.core.optimizer.emerging_optimizers")
    if emerging is None:
        return False
    from .. import optim

    return all(getattr(emerging, name, None) is getattr(optim, name) for name in _CLASS_NAMES)


def install(names: list[str] | None = None, *, replace_classes: bool = False, state_dtype: str | None = None,
            state_block_size: int | None = None, workspace_mib: Any = _UNSET,
            clip_policy: str | None = None, overlap_backward: bool | None = None) -> dict[str, Any]:
    """Puts megatron-eopt's registry entries into Megatron-LM's emerging-optimizer registry.

    ``names`` selects entries of :mod:`megatron_eopt.registry` (default: all of them, i.e.
    ``"muon"`` and ``"adaptive_muon"`` plus anything registered there). Idempotent: entries
    already installed are left alone. Returns ``{name: Megatron's previous entry or None}`` for
    the names this call replaced (empty when everything was already installed).

    Routing: an entry with the built-in rule, under a name Megatron-LM registers itself, keeps
    Megatron-LM's own ``default_param_overrides`` (plus ``use_muon = False`` → scalar optimizer
    where that megatron-core ignores the flag); other entries bring their own overrides. With such
    an entry installed, where megatron-core's layer-wise ownership rule
    (``is_managed_by_layer_wise_optimizer``) ignores ``use_muon``, it is made to leave those
    parameters to the scalar optimizer too, as later megatron-core releases do; call install()
    before the model is wrapped in DDP.

    ``replace_classes=True`` (off by default) also binds the module-level names
    ``TensorParallelMuon`` and ``TensorParallelAdaptiveMuon`` of
    ``megatron.core.optimizer.emerging_optimizers`` to megatron-eopt's classes, so code that
    builds Megatron's classes by name (``emerging_optimizers.TensorParallelMuon(...)``, looked
    up at call time) gets ours. It needs both "muon" and "adaptive_muon" installed (by this call
    or an earlier one), else ValueError: Megatron's own TensorParallelAdaptiveMuon calls
    ``TensorParallelMuon.__init__`` by that name. A ``from ... import TensorParallelMuon`` done
    before install() keeps the name it bound.
    :func:`uninstall` restores the names.

    Memory of the optimizers built through the installed entries (those whose constructor takes
    them: Muon and AdaptiveMuon, i.e. "muon" and "adaptive_muon"): ``state_dtype`` ("fp32", "bf16",
    "int8", "fp8") and ``state_block_size`` store the momentum (and AdaMuon's second moment) in
    low precision; ``workspace_mib`` is the step's workspace budget in MiB ("auto": by device; None: no bound). Left
    out, the class defaults (fp32 state, budget "auto"); a later call changes them for the optimizers
    built after it. Per build, an attribute set on Megatron-LM's ``OptimizerConfig`` wins:
    ``muon_state_dtype``, ``muon_state_block_size``, ``muon_workspace_mib``.

    ``overlap_backward=True`` (off by default; per build ``muon_overlap_backward`` on the config wins)
    builds the orthogonalizing optimizers with ``overlap_backward``: under Megatron DDP each matrix's
    momentum and Newton–Schulz start as its bucket group's gradient reduction finishes during
    backward (``overlap_grad_reduce``), bitwise the step without overlap
    (:mod:`.megatron_overlap`); under torch FSDP2 as FSDP2's reduce-scatter finishes. Muon's gradients
    must not be clipped (``clip_policy`` "adamw", the default).

    Gradient clipping: Megatron-LM's chained and layer-wise optimizers clip every sub-optimizer by one
    norm of all gradients (``clip_grad``, 1.0 by default), the Muon one included. With ``clip_policy``
    "adamw" (the default; left out, an earlier call's choice stays) their step clips only the sub-optimizers that are not orthogonalizing
    (Adam, Lion), by the norm of their own gradients, and leaves Muon's gradients alone; "separate"
    clips each part by its own norm; "global" keeps Megatron-LM's own step. The step still returns
    the total norm of all gradients, and ``grad_norm_skip_threshold`` still compares with it; the
    parts' norms are on the optimizer as ``grad_norms_by_part`` after each step. Per build, an
    ``OptimizerConfig`` attribute ``muon_clip_policy`` wins. See
    :mod:`megatron_eopt.integrations.megatron_clipping`.

    Torch-FSDP2: megatron-core's torch_dist optimizer checkpoint (``sharded_state_dict``) cannot map
    DTensor parameters on torch 2.14, for any optimizer; after install() it stops with a ValueError
    that names torch.distributed.checkpoint (``--ckpt-format torch_dcp``) instead of megatron-core's
    "Param id 0 does not match any model sharded param". :func:`allow_torch_fsdp2` lets Megatron-LM's
    training script take ``--use-torch-fsdp2``.

    Raises ImportError with the reason when megatron-core is missing, older than 0.18, or fails
    to import.
    """
    if clip_policy is not None:
        megatron_clipping.check_policy(clip_policy)
    options = {k: v for k, v in (("state_dtype", state_dtype), ("state_block_size", state_block_size),
                                 ("overlap_backward", overlap_backward)) if v is not None}
    if workspace_mib is not _UNSET:
        options["workspace_mib"] = workspace_mib
    _check_step_options(options)
    factory, emerging = _megatron_modules()
    optimizer_config = importlib.import_module("megatron.core.optimizer.optimizer_config")
    selected = registry.names() if names is None else list(names)
    missing = {"muon", "adaptive_muon"} - set(selected) - set(installed())
    if replace_classes and missing:
        raise ValueError(
            "install(replace_classes=True) needs both 'muon' and 'adaptive_muon' installed (Megatron's "
            f"TensorParallelAdaptiveMuon calls TensorParallelMuon by name); not installed: {sorted(missing)}"
        )
    entries = {name: registry.get(name) for name in selected}  # KeyError for unknown names first
    replaced: dict[str, Any] = {}
    with _LOCK:
        table = emerging._EMERGING_OPTIMIZERS
        for name, entry in entries.items():
            current = table.get(name)
            if current is not None and is_ours(current) and current.optimizer_cls is entry.optimizer_cls:
                continue
            stock = _REPLACED.get(name, current)
            megatron_entry = _to_megatron_entry(entry, emerging, optimizer_config, stock)
            megatron_entry._megatron_eopt = True
            if name not in _REPLACED:
                _REPLACED[name] = current
            replaced[name] = current
            table[name] = megatron_entry
        _STEP_OPTIONS.update(options)
        guard_torch_dist_under_fsdp2()
        # Megatron-FSDP v2 builds its Muon outside the registry: refuse there rather than train with another.
        guard_fsdp_muon(lambda: "muon" in installed())
        megatron_clipping.patch(importlib.import_module("megatron.core.optimizer.optimizer").ChainedOptimizer,
                                clip_policy)
        if replace_classes:
            _bind_classes(emerging)
        # The layer-wise buffer rule follows the routing of use_muon = False only where our
        # entries route by Megatron's rule; an entry with its own overrides decides for itself.
        if any(is_ours(e) and getattr(e, "_megatrons_routing", False) for e in table.values()):
            _align_layer_wise_ownership(factory)
        # Megatron refuses its emerging-optimizer path without Emerging-Optimizers installed;
        # ours do not need it. Keep Lion (which does) failing with a clear ImportError.
        if not getattr(factory, "HAVE_EMERGING_OPTIMIZERS", True):
            set_global(factory, "HAVE_EMERGING_OPTIMIZERS", True)
            if not hasattr(factory, "Lion"):
                set_global(factory, "Lion", _LionNeedsEmergingOptimizers)
    return replaced


# The Megatron-LM pull requests whose behaviour the plug follows beyond megatron-core 0.19.2 and main
# at d98e8a6, and what of each was read (docs/megatron.md has the details).
FOLLOWED_PULL_REQUESTS: tuple[tuple[str, str], ...] = (
    ("#6664", "tp_mode 'auto': merged after d98e8a6, read from its thread and review diff"),
    ("#7236", "GTP updates scaled by the real shape: merged, read from its diff"),
    ("#6688", "split_glu: open, its head with _gather_glu_grad / glu_interleave_size"),
    ("#6326 / #7085", "split_qkv_per_head, qkv_layout, MLA: open, #6326's head with _localize_qkv_split_shapes"),
    ("#6422", "muon_ht (TensorParallelMuonHT): open, its description and document"),
    ("#6425", "FsdpMuon(inner_optimizer=...): open, its head as read in 2026-12"),
    ("#5986", "Megatron-FSDP v2's Muon factory: open, refused under install() unless our Muon is the inner one"),
    ("#6683", "layer-sharded homes over GTP x TP: open, its description (its tp_gtp_remat group where the "
              "pg_collection has one, else a relay over TP then GTP)"),
    ("#5925", "constructor_only_kwargs of the optimizer recipes: open"),
    ("#6720", "overlap with backward: in progress, not readable here; ours is overlap_backward"),
)


def version_report() -> str:
    """The megatron-core the plug runs against (its version, as ``import megatron.core`` would load
    it) and the Megatron-LM pull requests whose behaviour it follows beyond it."""
    version = megatron_core_version()
    lines = ["megatron-core " + (".".join(map(str, version)) if version else "(not installed)"),
             "Megatron-LM pull requests followed:"]
    lines += [f"  {pr}: {what}" for pr, what in FOLLOWED_PULL_REQUESTS]
    return "\n".join(lines)


def _check_step_options(options: dict[str, Any]) -> None:
    """Refuses a bad memory option at install() rather than at the first optimizer build."""
    from .. import low_memory_state as lms
    from ..optim.step.grouping import check_workspace_mib

    if "state_dtype" in options:
        lms.validate_state_dtype(options["state_dtype"])
    if "state_block_size" in options:
        lms.validate_block_size(options["state_block_size"])
    if "workspace_mib" in options:
        check_workspace_mib(options["workspace_mib"])
    if "overlap_backward" in options and not isinstance(options["overlap_backward"], bool):
        raise TypeError(f"overlap_backward must be True or False, got {options['overlap_backward']!r}")


def uninstall() -> None:
    """Restores the Megatron-LM registry, module flags and class names as they were before :func:`install`
    (and forgets its memory options)."""
    if "megatron.core.optimizer.emerging_optimizers" not in sys.modules:
        return
    table = sys.modules["megatron.core.optimizer.emerging_optimizers"]._EMERGING_OPTIMIZERS
    with _LOCK:
        for name, previous in _REPLACED.items():
            if previous is None:
                table.pop(name, None)
            else:
                table[name] = previous
        _REPLACED.clear()
        _STEP_OPTIONS.clear()
        megatron_clipping.unpatch()
        restore_globals()
