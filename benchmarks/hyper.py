"""The one set of hyper-parameters every implementation runs with, so that they do the same math.

A run picks its Newton–Schulz schedule and precision per device (``configure``):
- CUDA: the "simple" schedule (Keller Jordan's row, the only kind torch.optim.Muon takes) in
  precision "medium" (bf16 products), what GPU trainers run.
- CPU: the default "quintic" schedule in precision "highest" (fp32) unless ``--precision`` says
  otherwise; RESULTS.md keeps one CPU table per precision, "medium" (bf16 products, the optimizers'
  default, fast on CPUs with AVX512-BF16 or AMX such as the development machine; CPUs without them
  fall back to much slower bf16 kernels) and "highest". torch.optim.Muon (bf16 only, one (a, b, c)
  row) runs only with a single-row schedule.
Any schedule with c != 0 costs the same FLOPs. torch.optim.Muon's "original" lr adjustment is
the "shape_scaling" scale mode; weight decay is decoupled in all.
"""

from __future__ import annotations

from megatron_eopt.newton_schulz import get_coefficients

NS_STEPS = 5
EPS = 1e-7
PRESETS = {
    "cuda": dict(coefficient_type="simple", precision="medium"),
    "cpu": dict(coefficient_type="quintic", precision="highest"),
}
COEFFICIENT_TYPE = PRESETS["cuda"]["coefficient_type"]
PRECISION = PRESETS["cuda"]["precision"]  # medium: bf16 products, fp32 accumulation, fp32 in and out
COEFFICIENTS = [tuple(row) for row in get_coefficients(COEFFICIENT_TYPE, NS_STEPS)]

LR = 0.02
MOMENTUM = 0.95
WEIGHT_DECAY = 0.01
NESTEROV = True
SCALE_MODE = "shape_scaling"
EXTRA_SCALE = 1.0

# AdaptiveMuon second-moment constants (docs/design.md §4.7 defaults).
BETA2 = 0.95
MOMENT2_EPS = 1e-8


def configure(device_type: str, coefficient_type: str | None = None, precision: str | None = None) -> None:
    """Sets the schedule and precision of this run: the device's preset unless given."""
    global COEFFICIENT_TYPE, PRECISION, COEFFICIENTS
    preset = PRESETS["cuda" if device_type == "cuda" else "cpu"]
    COEFFICIENT_TYPE = coefficient_type or preset["coefficient_type"]
    PRECISION = precision or preset["precision"]
    COEFFICIENTS = [tuple(row) for row in get_coefficients(COEFFICIENT_TYPE, NS_STEPS)]


def step_settings() -> dict:
    """The per-step hyper-parameters every optimizer of a run shares (its constructor's keywords)."""
    return dict(lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, nesterov=NESTEROV)


def single_row() -> bool:
    """True when every step uses the same (a, b, c) row (what torch.optim.Muon can run)."""
    return len(set(COEFFICIENTS)) == 1


def ns_flops(m: int, n: int, steps: int = NS_STEPS) -> float:
    """FLOPs of one standard Newton–Schulz on an (m, n) matrix with full GEMMs: per step X·Xᵀ, A·A, B·X."""
    s, l = min(m, n), max(m, n)
    return steps * (4.0 * s * s * l + 2.0 * s**3)


def gram_ns_flops(m: int, n: int, restarts, steps: int = NS_STEPS) -> float:
    """FLOPs of one Gram Newton–Schulz (docs/design.md §4.4) on an (m, n) matrix with full GEMMs, restarting
    before the steps flagged in ``restarts``: R = X·Xᵀ and X = Q·X with the long side once per
    (re)start and at the end; per step P = aI + bR + cR² (one s³ product), R ← P·R·P (two, not
    at the last step of a segment) and Q ← Q·P (one, not at the first)."""
    s, l = min(m, n), max(m, n)
    flops = 2.0 * s * s * l  # R
    for k in range(steps):
        if k > 0 and restarts[k]:
            flops += 4.0 * s * s * l  # X = Q X, R = X X^T
        first = k == 0 or restarts[k]
        last = k + 1 == steps or restarts[k + 1]
        flops += 2.0 * s**3 + (0.0 if last else 4.0 * s**3) + (0.0 if first else 2.0 * s**3)
    return flops + 2.0 * s * s * l  # X = Q X0


def describe() -> str:
    bits = "bf16 products" if PRECISION == "medium" else ("TF32 products" if PRECISION == "high" else "fp32 products")
    return (
        f"NS {COEFFICIENT_TYPE} x{NS_STEPS}, precision {PRECISION} ({bits}); Muon lr {LR}, momentum "
        f"{MOMENTUM}, Nesterov {NESTEROV}, decoupled weight decay {WEIGHT_DECAY}, scale {SCALE_MODE}"
    )
