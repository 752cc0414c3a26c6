"""Keller Jordan's ``MuonWithAuxAdam`` (Muon for the hidden matrices, Adam(W) for the rest) on
:class:`megatron_eopt.optim.HybridMuon` (served by ``megatron_eopt.muon``).

EMA momentum with Nesterov, the original quintic in bf16, ``p *= 1 - lr·wd`` and
``p -= lr·√max(1, m/n)·update``; Adam(W) with bias correction for the rest, group keys ``lr``,
``betas``, ``eps``, ``weight_decay``.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..optim.hybrid import HybridMuon
from ._deprecation import _warn_once
from .snippet import SNIPPET_MUON


class MuonWithAuxAdam(HybridMuon):
    """Keller Jordan's ``MuonWithAuxAdam(param_groups)``: groups with ``use_muon=True`` take ``lr``
    (0.02), ``momentum`` (0.95) and ``weight_decay`` (0); the others ``lr`` (3e-4), ``betas``
    ((0.9, 0.95)), ``eps`` (1e-10) and ``weight_decay`` (0)."""

    def __init__(self, param_groups: Iterable[Mapping[str, Any]]) -> None:
        _warn_once(type(self).__name__)
        groups = []
        for g in param_groups:
            g = dict(g)
            if g.get("use_muon") is False:
                g.setdefault("lr", 3e-4)
                g.setdefault("betas", (0.9, 0.95))
                g.setdefault("eps", 1e-10)
                g.setdefault("weight_decay", 0.0)
            groups.append(g)
        super().__init__(
            groups,
            lr=0.02,
            momentum=0.95,
            weight_decay=0.0,
            nesterov=True,
            num_ns_steps=5,
            nd_mode="flatten",
            **SNIPPET_MUON,
        )


class SingleDeviceMuonWithAuxAdam(MuonWithAuxAdam):
    """The single-device variant of :class:`MuonWithAuxAdam` (the same numbers)."""
