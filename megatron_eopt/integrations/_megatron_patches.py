"""What megatron-eopt changes in Megatron-LM's modules, recorded so that ``uninstall()`` puts it back.

``set_global`` replaces one module-level name and remembers the old value; ``restore_globals``
undoes every replacement, last first; ``installed`` lists the registry names whose entry is ours.
"""

from __future__ import annotations

import sys
from typing import Any

_PATCHED_GLOBALS: list[tuple[Any, str, Any, bool]] = []


def is_ours(megatron_entry: Any) -> bool:
    return getattr(megatron_entry, "_megatron_eopt", False)


def set_global(module: Any, name: str, value: Any) -> None:
    had = hasattr(module, name)
    _PATCHED_GLOBALS.append((module, name, getattr(module, name, None), had))
    setattr(module, name, value)


def restore_globals() -> None:
    while _PATCHED_GLOBALS:
        module, name, value, had = _PATCHED_GLOBALS.pop()
        if had:
            setattr(module, name, value)
        else:
            delattr(module, name)


def installed() -> list[str]:
    """Names whose Megatron-LM registry entry is currently megatron-eopt's."""
    if "megatron.core.optimizer.emerging_optimizers" not in sys.modules:
        return []
    table = sys.modules["megatron.core.optimizer.emerging_optimizers"]._EMERGING_OPTIMIZERS
    return sorted(name for name, entry in table.items() if is_ours(entry))
