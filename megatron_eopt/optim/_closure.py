"""torch.optim's closure convention, in one place for the optimizers that take a closure."""

from __future__ import annotations

from typing import Callable

import torch


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """The loss of ``closure`` evaluated with gradients on (``step()`` runs under no_grad), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
