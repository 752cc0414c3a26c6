"""Emerging-Optimizers 0.4.0, imported beside the installed 0.3.0 for the 0.4 parity tests.

0.3.0 stays the system-wide ``emerging_optimizers`` (the 0.3.0 parity tests and Megatron-LM use it).
0.4.0 lives in its own directory: ``$MEGATRON_EOPT_EO040`` if set, else ``.reference/
emerging_optimizers-0.4.0`` in the repository, where ``scripts/install.sh`` puts it when the wheel
is in ``../shared/wheels``; if only the wheel is there, it is unpacked into that directory here (a
pure-Python wheel is a zip). :func:`load` imports the 0.4.0 modules with the 0.3.0 ones set aside,
then puts 0.3.0 back: the returned modules keep working (EO imports everything at module level)
and every other test module still sees 0.3.0.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import typing
import zipfile
from types import SimpleNamespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WHEEL_GLOB = os.path.join(os.path.dirname(REPO), "shared", "wheels", "emerging_optimizers-0.4.0-*.whl")
TARGET = os.environ.get("MEGATRON_EOPT_EO040", os.path.join(REPO, ".reference", "emerging_optimizers-0.4.0"))
MODULES = (
    "registry",
    "orthogonalized_optimizers.muon_utils",
    "orthogonalized_optimizers.orthogonalized_optimizer",
    "orthogonalized_optimizers.muon",
    "orthogonalized_optimizers.adaptive_muon",
    "orthogonalized_optimizers.scion",
    "orthogonalized_optimizers.mop",
    "orthogonalized_optimizers.muon_hyperball",
    "orthogonalized_optimizers.polargrad",
    "orthogonalized_optimizers.spel",
    "orthogonalized_optimizers.spectral_clipping_utils",
    "contrib.muown",
)


def _directory() -> str:
    if os.path.isdir(os.path.join(TARGET, "emerging_optimizers")):
        return TARGET
    wheels = sorted(glob.glob(WHEEL_GLOB))
    if not wheels:
        pytest.skip(
            f"Emerging-Optimizers 0.4.0 is not available: no wheel matching {WHEEL_GLOB} and nothing installed "
            f"in {TARGET} (set MEGATRON_EOPT_EO040 to a directory holding it)",
            allow_module_level=True,
        )
    os.makedirs(TARGET, exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extractall(TARGET)
    return TARGET


def _is_eo(name: str) -> bool:
    return name == "emerging_optimizers" or name.startswith("emerging_optimizers.")


def load() -> SimpleNamespace:
    """The 0.4.0 modules, by their last name (``muon``, ``scion``, ``muown``, ``registry``, ...)."""
    directory = _directory()
    if not hasattr(typing, "override"):  # EO declares Python >= 3.12
        import typing_extensions

        typing.override = typing_extensions.override
    saved = {name: mod for name, mod in sys.modules.items() if _is_eo(name)}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, directory)
    try:
        modules = {m.rsplit(".", 1)[-1]: importlib.import_module(f"emerging_optimizers.{m}") for m in MODULES}
        version = importlib.import_module("emerging_optimizers.package_info").__version__
    finally:
        sys.path.remove(directory)
        for name in [n for n in sys.modules if _is_eo(n)]:
            del sys.modules[name]
        sys.modules.update(saved)
    if version != "0.4.0":
        raise RuntimeError(f"{directory} holds Emerging-Optimizers {version}, not 0.4.0")
    return SimpleNamespace(**modules)
