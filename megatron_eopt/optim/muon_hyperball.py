"""MuonHyperball: Muon with norm-preserving (hyperball) weight updates (Emerging-Optimizers 0.4)."""

from __future__ import annotations

from typing import Any

import torch

from .muon import Muon
from .weight_update_hooks import HyperballHook


class MuonHyperball(Muon):
    """Muon on the sphere of Frobenius radius ``hyperball_radius``:
    ``W ← R·normalize(W − lr·R·normalize(update))``, EO 0.4's constructor and numerics.

    Every parameter must already have norm ``hyperball_radius`` (relative tolerance 1e-5) and a
    norm above ``hyperball_eps``: ValueError otherwise, at construction. Implemented as Muon with a
    :class:`~megatron_eopt.optim.weight_update_hooks.HyperballHook` (EO main's form), so the norms
    run batched in the fused step; like EO main, it refuses a ``weight_update_hook`` of the caller's
    (KeyError). Other arguments as :class:`Muon`.
    """

    def __init__(self, *args: Any, hyperball_radius: float, hyperball_eps: float = 1e-15, **kwargs: Any) -> None:
        if "weight_update_hook" in kwargs:
            raise KeyError(
                "MuonHyperball does not accept a 'weight_update_hook' argument; it manages its own HyperballHook."
            )
        self.hyperball_radius = hyperball_radius
        self.hyperball_eps = hyperball_eps
        kwargs["weight_update_hook"] = HyperballHook(radius=hyperball_radius, eps=hyperball_eps)
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    norm = torch.linalg.vector_norm(p, dtype=torch.float32)
                    if norm <= hyperball_eps:
                        raise ValueError(
                            "MuonHyperball requires all parameters to have non-zero norm; "
                            f"param_groups[{gi}]['params'][{pi}] has norm {float(norm)}."
                        )
                    radius = torch.tensor(hyperball_radius, dtype=norm.dtype, device=norm.device)
                    if not torch.isclose(norm, radius, atol=0, rtol=1e-5):
                        raise ValueError(
                            f"hyperball_radius={hyperball_radius} was specified but param_groups[{gi}]['params'][{pi}] "
                            f"has Frobenius norm {float(norm)}. Rescale your model parameters to the desired radius "
                            "before constructing the optimizer."
                        )
