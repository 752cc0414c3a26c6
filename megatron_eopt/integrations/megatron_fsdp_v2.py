"""Megatron-FSDP v2 (``--megatron-fsdp-version 2``) and install().

Megatron-LM builds Muon for Megatron-FSDP v2 as ``FsdpMuon(params, inner_optimizer=<a Muon>, dp_mesh=...)``
(PR #6425's class; PR #5986's factory path), and that path constructs its inner Muon itself, not from
the emerging-optimizer registry: the "muon" entry install() puts there never reaches it. So that a run
does not silently train with another optimizer than the one installed, install() makes ``FsdpMuon``
refuse an inner optimizer that is not megatron-eopt's while our "muon" is installed, with a message
that says how to pass ours (``inner_optimizer=megatron_eopt.optim.Muon(...)``: every attribute and
method FsdpMuon reads exists on it with Megatron's meaning). ``uninstall()`` lifts it.

``FsdpMuon`` is looked for in the Megatron-FSDP packages (megatron-core's bundled copy and the
standalone ``megatron_fsdp``), by the text of their modules: only a module that defines it is
imported. megatron-core 0.19.2 has none, and then nothing is changed.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from typing import Any, Callable

from ._megatron_patches import set_global

FSDP_PACKAGES = (
    "megatron.core.distributed.fsdp.src.megatron_fsdp",
    "megatron_fsdp",
)

REFUSAL = (
    "Megatron-FSDP v2 builds its Muon (FsdpMuon with an inner optimizer it constructs itself) by a path that does "
    "not go through the emerging-optimizer registry, so the 'muon' that megatron_eopt's install() put there would "
    "not be used: got inner_optimizer of type {inner}. Pass ours, "
    "FsdpMuon(params, inner_optimizer=megatron_eopt.optim.Muon(params, ...), dp_mesh=...), or call "
    "megatron_eopt.integrations.megatron.uninstall() to train with Megatron-LM's own Muon."
)


def _module_names_defining(package: str, class_name: str) -> list[str]:
    """Modules of ``package`` (and its subpackages) whose source defines ``class_name``, without importing them."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    names = []
    needle = re.compile(rf"^class {class_name}\b", re.M)
    for root in spec.submodule_search_locations:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(("_", "."))]
            for file in files:
                if not file.endswith(".py"):
                    continue
                path = os.path.join(folder, file)
                try:
                    with open(path, encoding="utf-8") as f:
                        if not needle.search(f.read()):
                            continue
                except OSError:
                    continue
                relative = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
                names.append(package + "." + relative.removesuffix(".__init__"))
    return names


def fsdp_muon_classes(packages=None) -> list[type]:
    """The ``FsdpMuon`` classes of the installed Megatron-FSDP packages (``packages``, None:
    :data:`FSDP_PACKAGES`; none in megatron-core 0.19.2)."""
    classes = []
    for package in FSDP_PACKAGES if packages is None else packages:
        for name in _module_names_defining(package, "FsdpMuon"):
            try:
                cls = getattr(importlib.import_module(name), "FsdpMuon", None)
            except ImportError:
                continue
            if isinstance(cls, type) and cls not in classes:
                classes.append(cls)
    return classes


def _is_ours(optimizer: Any) -> bool:
    from ..optim.orthogonalized import OrthogonalizedOptimizer

    return isinstance(optimizer, OrthogonalizedOptimizer)


def guard_fsdp_muon(muon_is_ours: Callable[[], bool], packages=None) -> list[type]:
    """Makes each ``FsdpMuon`` refuse (ValueError, :data:`REFUSAL`) an inner optimizer that is not ours
    while ``muon_is_ours()``; recorded with ``set_global``, so ``uninstall()`` restores the classes.
    Returns the classes guarded."""
    guarded = []
    for cls in fsdp_muon_classes(packages):
        if getattr(cls.__init__, "_megatron_eopt_guard", False):
            continue
        original = cls.__init__

        def __init__(self, params, inner_optimizer=None, *args, __original=original, **kwargs):
            if muon_is_ours() and inner_optimizer is not None and not _is_ours(inner_optimizer):
                raise ValueError(REFUSAL.format(inner=type(inner_optimizer).__module__ + "."
                                                + type(inner_optimizer).__qualname__))
            __original(self, params, inner_optimizer, *args, **kwargs)

        __init__._megatron_eopt_guard = True
        set_global(cls, "__init__", __init__)
        guarded.append(cls)
    return guarded
