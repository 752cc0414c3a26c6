"""The one set of hyper-parameters every implementation runs with, so that they do the same math.

torch.optim.Muon takes a single (a, b, c) row, applied at every step, so the benchmarks use the
"simple" schedule (Keller Jordan's row) everywhere; any schedule with c != 0 costs the same FLOPs.
Its "original" lr adjustment is the "shape_scaling" scale mode; weight decay is decoupled in all.
"""

from __future__ import annotations

from megatron_eopt.newton_schulz import get_coefficients

NS_STEPS = 5
COEFFICIENT_TYPE = "simple"
PRECISION = "medium"  # bf16 products, fp32 accumulation, fp32 in and out
EPS = 1e-7
COEFFICIENTS = [tuple(row) for row in get_coefficients(COEFFICIENT_TYPE, NS_STEPS)]

LR = 0.02
MOMENTUM = 0.95
WEIGHT_DECAY = 0.01
NESTEROV = True
SCALE_MODE = "shape_scaling"
EXTRA_SCALE = 1.0

# AdaptiveMuon second-moment constants (DESIGN §4.4 defaults).
BETA2 = 0.95
MOMENT2_EPS = 1e-8


def ns_flops(m: int, n: int, steps: int = NS_STEPS) -> float:
    """FLOPs of one Newton–Schulz on an (m, n) matrix with full GEMMs: per step X·Xᵀ, A·A, B·X."""
    s, l = min(m, n), max(m, n)
    return steps * (4.0 * s * s * l + 2.0 * s**3)


def describe() -> str:
    return (
        f"NS {COEFFICIENT_TYPE} x{NS_STEPS}, precision {PRECISION} (bf16 products); Muon lr {LR}, momentum "
        f"{MOMENTUM}, Nesterov {NESTEROV}, decoupled weight decay {WEIGHT_DECAY}, scale {SCALE_MODE}"
    )
