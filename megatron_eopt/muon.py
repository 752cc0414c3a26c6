"""Backward-compatible names of the popular Muon snippets and of Megatron-LM's older ``muon.py``.

Code written against Keller Jordan's / nanochat's ``muon.py`` or modded-nanogpt keeps working
after changing its import to ``from megatron_eopt.muon import ...``, and runs on the fused ops:

- :func:`zeropower_via_newtonschulz5` — Newton–Schulz with the original quintic
  (3.4445, −4.7750, 2.0315), bf16 compute, tall inputs iterated transposed; returns bf16;
- :class:`Muon` — ``Muon(params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5)``, also
  spelled ``weight_decay=`` / ``backend="newtonschulz5", backend_steps=``;
- :class:`DistMuon` — nanochat's data-parallel Muon (reduce-scatter, owner updates, all-gather);
- :func:`get_megatron_muon_optimizer` — Megatron-LM's older factory, now
  ``get_megatron_optimizer`` after :func:`megatron_eopt.integrations.megatron.install`;
- ``TensorParallelMuon`` — Megatron-LM's class, now :class:`megatron_eopt.optim.TensorParallelMuon`;
- Motif's parallel Muon: ``Muon(groups flagged use_muon, ...)`` (its numbers, QK-clip semantics and
  checkpoint layout), ``get_default_muon_param_groups``, ``default_is_muon``, ``parse_qk_layer``.

``Muon`` and ``DistMuon`` follow nanochat's ``muon.py`` at 4ddc803, checkpoints included (the same
groups, indices, keys and owner ranks); nanochat since 2026 is :mod:`megatron_eopt.nanochat`.
Each class and factory warns once per process with a ``DeprecationWarning`` naming its replacement.
"""

from __future__ import annotations

from typing import Any

from .compat._deprecation import _warn_once, _warned  # noqa: F401  (tests reset the once-only warnings)
from .compat.aux_adam import MuonWithAuxAdam, SingleDeviceMuonWithAuxAdam
from .integrations.megatron_legacy import get_megatron_muon_optimizer
from .compat.motif import default_is_muon, get_default_muon_param_groups, parse_qk_layer
from .compat.snippet import DistMuon, Muon, zeropower_via_newtonschulz5

# TensorParallelMuon is served by __getattr__ (it warns when used, not on `import *`).
__all__ = [
    "DistMuon",
    "Muon",
    "MuonWithAuxAdam",
    "SingleDeviceMuonWithAuxAdam",
    "default_is_muon",
    "get_default_muon_param_groups",
    "get_megatron_muon_optimizer",
    "parse_qk_layer",
    "zeropower_via_newtonschulz5",
]


def __getattr__(name: str) -> Any:
    # Megatron-LM's older muon.py exported TensorParallelMuon.
    if name == "TensorParallelMuon":
        _warn_once("TensorParallelMuon")
        from .optim import TensorParallelMuon

        return TensorParallelMuon
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
