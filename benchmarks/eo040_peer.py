"""Emerging-Optimizers 0.4.0 as a benchmark peer, imported beside the installed 0.3.0.

0.4.0 is not on the package index: ``scripts/install.sh`` puts its wheel's contents into
``.reference/emerging_optimizers-0.4.0`` (or ``$MEGATRON_EOPT_EO040``). Its modules are imported
with 0.3.0's set aside and 0.3.0 is restored afterwards (EO imports at module level, so the
loaded classes keep working), as the 0.4 parity tests do.
"""

from __future__ import annotations

import importlib
import os
import sys
import typing
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.environ.get("MEGATRON_EOPT_EO040", os.path.join(REPO, ".reference", "emerging_optimizers-0.4.0"))
MODULES = ("orthogonalized_optimizers", "contrib.muown")
_CACHE: list = []


def load() -> tuple[SimpleNamespace | None, str | None]:
    """(namespace of EO 0.4.0's family classes, None) or (None, why it is not available)."""
    if _CACHE:
        return _CACHE[0]
    if not os.path.isdir(os.path.join(TARGET, "emerging_optimizers")):
        result = (None, f"Emerging-Optimizers 0.4.0 not installed in {TARGET} (scripts/install.sh puts it there)")
        _CACHE.append(result)
        return result
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override
    is_eo = lambda name: name == "emerging_optimizers" or name.startswith("emerging_optimizers.")  # noqa: E731
    saved = {name: mod for name, mod in sys.modules.items() if is_eo(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, TARGET)
    try:
        family = importlib.import_module("emerging_optimizers.orthogonalized_optimizers")
        muown = importlib.import_module("emerging_optimizers.contrib.muown")
        result = (SimpleNamespace(**{n: getattr(family, n) for n in dir(family) if not n.startswith("_")},
                                  Muown=muown.Muown), None)
    except Exception as exc:
        result = (None, f"Emerging-Optimizers 0.4.0 not importable ({type(exc).__name__}: {exc})")
    finally:
        sys.path.remove(TARGET)
        for name in [n for n in sys.modules if is_eo(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
    _CACHE.append(result)
    return result
