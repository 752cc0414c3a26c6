"""The 2026 Muon recipe in the Newton–Schulz ops: options of the fused Muon / AdaptiveMuon.

- MuonEq row equilibration (arXiv 2603.28254): before orthogonalization
  every row of the update is rescaled to the root-mean-square row norm,
  ``X ← X · (‖X‖_F / √m) / max(‖X_i‖, 1e-6)``, so the spectrum entering the iteration is better
  conditioned.
- The Frobenius normalization that starts the iteration, in both conventions found in the wild:
  ``"clamp"`` divides by ``max(‖X‖, eps)`` (Emerging-Optimizers), ``"add"`` by ``‖X‖ + eps`` (Keller
  Jordan's snippet, nanochat, modded-nanogpt); they differ only for norms near ``eps``. A
  ``norm_divisor`` s > 1 (Polar Express's safety factor, arXiv 2505.16932: nanochat uses 1.02, then
  1.01) divides by ``s·‖X‖`` instead, keeping rounding from pushing singular values past the
  interval the polynomials were fitted on.
- Muon+ (arXiv 2602.21545): after orthogonalization the update's Frobenius norm is set to
  ``√min(m, n)``, that of an exactly semi-orthogonal matrix, correcting under-convergence.

These run inside the Newton–Schulz ops (``eps_mode``, ``norm_divisor``, ``row_equilibration`` and
``frobenius_renorm`` of ``newton_schulz`` / ``newton_schulz_split``, csrc/include/megatron_eopt/
ns_recipe.h): MuonEq's row norms come from the same read of the input as its Frobenius norm and its
row factors and the chosen denominator are one multiply in the pass that writes the iteration's
input, so MuonEq and the conventions cost no extra pass; Muon+ costs one reduction over the result,
folded with the rescaling into the pass that writes the fp32 result. :class:`NSRecipe` holds the
validated settings.

Also here: :func:`polar_express_rows`, the Polar Express table for a given safety factor. Cautious
weight decay is not here: ``foreach_update_`` applies it (``weight_decay_method="cautious"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ops._newton_schulz import recipe_arguments


# Polar Express (Amsel, Persson, Musco, Gower, arXiv 2505.16932): the optimal odd quintics for
# Newton–Schulz's first steps, without the safety factor. Every row but the last is applied to
# X / s for a safety factor s, i.e. (a/s, b/s³, c/s⁵); the last row is the iteration's fixed point.
POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.948690853482295, -2.908902115962949, 0.5518191394370137),
    (3.318419657370602, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)


def polar_express_rows(safety: float) -> tuple[tuple[float, float, float], ...]:
    """The Polar Express table for a safety factor ``safety`` (≥ 1; 1.01 gives Emerging-Optimizers'
    ``polar_express`` table, which is this one cut to four decimals)."""
    if isinstance(safety, bool) or not isinstance(safety, (int, float)) or not math.isfinite(safety) or safety < 1:
        raise ValueError(f"polar_express_safety must be a finite number >= 1, got {safety!r}")
    s = float(safety)
    rows = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_RAW[:-1]]
    return tuple(rows) + (POLAR_EXPRESS_RAW[-1],)


@dataclass(frozen=True)
class NSRecipe:
    """The validated recipe settings the Newton–Schulz ops apply (defaults: nothing beyond the op's
    own ``max(‖X‖, eps)`` normalization)."""

    eps_mode: str = "clamp"
    norm_divisor: float = 1.0
    row_equilibration: bool = False
    frobenius_renorm: bool = False
    eps: float = 1e-7  # the normalization's eps (the reference packages' 1e-7; nanochat 1e-6 since 2026)

    @staticmethod
    def make(eps_mode: str = "clamp", norm_divisor: float = 1.0, row_equilibration: bool = False,
             frobenius_renorm: bool = False, eps: float = 1e-7) -> "NSRecipe":
        """Validated options (ValueError naming the argument)."""
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
            raise ValueError(f"ns_eps must be a number in (0, 1), got {eps!r}")
        arguments = recipe_arguments(eps_mode, norm_divisor, row_equilibration, frobenius_renorm, prefix="ns_")
        return NSRecipe(*arguments, float(eps))

    @property
    def op_arguments(self) -> tuple[str, float, bool, bool]:
        """The trailing arguments of the Newton–Schulz ops: eps_mode, norm_divisor,
        row_equilibration, frobenius_renorm."""
        return (self.eps_mode, self.norm_divisor, self.row_equilibration, self.frobenius_renorm)
