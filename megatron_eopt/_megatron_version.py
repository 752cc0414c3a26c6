"""The version of the megatron-core that ``import megatron.core`` would load, read without importing
it (its loaded ``package_info``, a Megatron-LM checkout's ``package_info.py`` on ``sys.path``, or the
installed distribution's metadata). Below the registry and the Megatron integration, which both name
the version in their messages."""

from __future__ import annotations

import re
import sys


def _parse_version(text: str) -> tuple[int, ...]:
    """'0.19.2' -> (0, 19, 2); '0.18.0rc1+abc' -> (0, 18, 0)."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text.strip())
    if match is None:
        return ()
    return tuple(int(g) for g in match.groups() if g is not None)


def megatron_core_version() -> tuple[int, ...] | None:
    """The version of the megatron-core that ``import megatron.core`` loads, as a tuple, or None
    when there is none: a Megatron-LM checkout ahead of an installed release on ``sys.path`` is the
    one reported (its ``package_info.py``, read without importing ``megatron.core``), then the
    installed distribution's metadata."""
    from importlib import metadata

    info = sys.modules.get("megatron.core.package_info")
    if info is not None and hasattr(info, "__version__"):
        return _parse_version(info.__version__)
    source = _package_info_source()
    if source is not None:
        parts = [re.search(rf"^{name}\s*=\s*(\d+)", source, re.MULTILINE) for name in ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            return tuple(int(m.group(1)) for m in parts)
    try:
        return _parse_version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:
        return None


def _package_info_source() -> str | None:
    """The text of megatron/core/package_info.py where ``import megatron.core`` would find it."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "package_info.py")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
    return None


def megatron_emerging_source() -> str | None:
    """The text of megatron/core/optimizer/emerging_optimizers.py where ``import megatron.core`` would
    find it (``megatron`` is a namespace package: the first ``megatron/core`` package on its path), read
    without importing megatron."""
    import importlib.machinery
    import os

    spec = importlib.machinery.PathFinder.find_spec("megatron")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.isfile(os.path.join(folder, "core", "__init__.py")):
            path = os.path.join(folder, "core", "optimizer", "emerging_optimizers.py")
            if not os.path.isfile(path):
                return None
            with open(path, encoding="utf-8") as f:
                return f.read()
    return None
