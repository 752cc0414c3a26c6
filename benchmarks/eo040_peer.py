"""Emerging-Optimizers 0.4.0 as a benchmark peer: not available.

0.4.0 is not on the package index and is not installed (0.3.0 is, from the index). The family
workloads time megatron-eopt's classes alone and list this peer as skipped, with the reason
below; 0.4.0's numerics are compared through the float64 re-expressions in
``tests/python/support/eo040_reference.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

UNAVAILABLE = ("Emerging-Optimizers 0.4.0 is not on the package index and is not installed; its behaviour "
               "is compared through float64 re-expressions in the tests (tests/python/support/eo040_reference.py)")


def load() -> tuple[SimpleNamespace | None, str | None]:
    """(None, why the peer is not available): the interface of a peer loader, with no peer."""
    return None, UNAVAILABLE
