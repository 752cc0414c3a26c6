"""Newton–Schulz coefficient sets, schedules and Muon scale factors.

Pure Python (no compiled code needed): the tables and rules here are what the op consumes.
"""

from __future__ import annotations

import math
from itertools import chain, cycle, islice, repeat
from typing import Iterator, Literal, Sequence, get_args

CoefficientRow = tuple[float, float, float]
NSCoeffT = Literal["simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "cubic5", "custom"]
CoeffIterMode = Literal["cycle", "repeat_last"]
MuonScaleT = Literal["spectral", "shape_scaling", "unit_rms_norm"]
SCALE_MODES: tuple[str, ...] = get_args(MuonScaleT)
PrecisionT = Literal["medium", "high", "highest"]
NSAlgorithmT = Literal["auto", "standard", "gram"]

# "standard": the iteration on X (docs/design.md §4.1). "gram": the same iteration run on the Gram matrix
# X·Xᵀ of the short side (§4.4), fewer FLOPs for rectangular matrices. "auto": gram where it does
# less work on the device (and its precision keeps it within the standard tolerances), else standard.
NS_ALGORITHMS: tuple[str, ...] = get_args(NSAlgorithmT)
# How one call computes its products with a symmetric result (X·Xᵀ, G·G, the Gram iteration's s×s
# products): "auto" as the device's measurement or the process-wide setting decides
# (set_cpu_symmetric_products, set_cuda_symmetric_products); "symmetric" the symmetric kernel, or
# lower block panels and a mirror, wherever the side allows them; "full" one GEMM each.
NSProductsT = Literal["auto", "symmetric", "full"]
NS_PRODUCTS: tuple[str, ...] = get_args(NSProductsT)
# How the Frobenius normalization uses eps: "clamp" divides by max(‖x‖, eps) (Emerging-Optimizers),
# "add" by ‖x‖ + eps (Keller Jordan's snippet, nanochat).
EpsModeT = Literal["clamp", "add"]
EPS_MODES: tuple[str, ...] = get_args(EpsModeT)

# Each row (a, b, c) maps a singular value s to a*s + b*s^3 + c*s^5.
COEFFICIENT_SETS: dict[str, tuple[CoefficientRow, ...]] = {
    # Keller Jordan's original quintic.
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Per-step tuned quintic (modded-nanogpt).
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Polar Express (arXiv:2505.16932), including its 1.01^degree safety division.
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    # CANS (arXiv:2506.10935): Remez polynomials on an adaptive interval.
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    # AOL rows, used without the paper's row rescaling: with Frobenius normalization that
    # rescaling flips the sign of a near-rank-1 input.
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    # DeepSeek-V4: eight simple steps, then two steps converging to 1.
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    # Relaxed cubic schedule (arXiv:2606.00371, Emerging-Optimizers 0.4): c = 0, so each step is
    # X <- a·X + b·(X·Xᵀ)·X without the Gram square. Tuned as a whole: runs exactly its 5 rows.
    "cubic5": (
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ),
}

# Schedules tuned to finish near 1 keep their last row when run longer; the others cycle.
REPEAT_LAST_TYPES = frozenset({"polar_express", "cans", "deepseekv4"})
# Schedules valid only for exactly as many steps as they have rows.
FIXED_LENGTH_TYPES = frozenset({"cubic5"})

# Frobenius-normalization floor of Newton–Schulz: Emerging-Optimizers 0.4 uses 1e-15 (a gradient
# of tiny norm is still orthogonalized to unit singular values); 0.3.0 (and so Megatron-LM's
# classes, which pin it) used 1e-7.
NS_EPS = 1e-15
NS_EPS_EO_030 = 1e-7


def get_supported_coefficient_types() -> list[str]:
    """Names accepted as ``coefficient_type`` (``custom`` needs ``custom_coefficient_sets``)."""
    return [*COEFFICIENT_SETS, "custom"]


def validate_coefficient_type(coefficient_type: str) -> None:
    """Raises ValueError naming the supported types when ``coefficient_type`` is unknown."""
    if coefficient_type not in COEFFICIENT_SETS and coefficient_type != "custom":
        raise ValueError(
            f"Invalid coefficient type: {coefficient_type!r}; coefficient_type must be one of "
            f"{get_supported_coefficient_types()}"
        )


def coefficient_table(
    coefficient_type: str, custom_coefficient_sets: Sequence[Sequence[float]] | None = None
) -> tuple[tuple[CoefficientRow, ...], bool]:
    """The (a, b, c) table of a coefficient type and whether it repeats its last row."""
    validate_coefficient_type(coefficient_type)
    if coefficient_type != "custom":
        return COEFFICIENT_SETS[coefficient_type], coefficient_type in REPEAT_LAST_TYPES
    if not custom_coefficient_sets:
        raise ValueError(
            "custom_coefficient_sets must be provided when coefficient_type is 'custom' (a non-empty list of (a, b, c))"
        )
    rows = []
    for i, row in enumerate(custom_coefficient_sets):
        if len(row) != 3:
            raise ValueError(f"custom_coefficient_sets[{i}] must be an (a, b, c) triple, got {row!r}")
        rows.append((float(row[0]), float(row[1]), float(row[2])))
    return tuple(rows), False


def check_steps(coefficient_type: str, steps: int, *, allow_zero: bool = True) -> None:
    """Raises ValueError for a step count the schedule cannot run (negative, or a fixed-length
    schedule run for another length). ``steps=0`` means normalize only."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < (0 if allow_zero else 1):
        raise ValueError(f"steps must be at least {0 if allow_zero else 1}, got {steps}")
    if coefficient_type in FIXED_LENGTH_TYPES and steps != len(COEFFICIENT_SETS[coefficient_type]):
        n = len(COEFFICIENT_SETS[coefficient_type])
        raise ValueError(
            f"{coefficient_type} is a fixed {n}-step schedule; got steps={steps}. "
            f"Use steps={n}, or pass its rows as custom_coefficient_sets."
        )


def get_coefficient_iterator(
    steps: int,
    coefficient_sets: Sequence[CoefficientRow],
    mode: CoeffIterMode = "cycle",
) -> Iterator[CoefficientRow]:
    """Emerging-Optimizers' iterator over ``steps`` rows of a table: ``"cycle"`` restarts after the
    last row, ``"repeat_last"`` keeps yielding it. ValueError for an empty table or unknown mode."""
    if not coefficient_sets:
        raise ValueError("coefficient_sets must be non-empty.")
    if mode == "cycle":
        rows = cycle(coefficient_sets)
    elif mode == "repeat_last":
        rows = chain(coefficient_sets, repeat(coefficient_sets[-1]))
    else:
        raise ValueError(f"Invalid mode: {mode}. Expected 'cycle' or 'repeat_last'.")
    return islice(rows, steps)


def get_coefficients(
    coefficient_type: str = "quintic",
    steps: int = 5,
    custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
) -> list[CoefficientRow]:
    """The ``steps`` rows a schedule runs, after cycling or repeating its last row (none for 0)."""
    check_steps(coefficient_type, steps)
    table, repeat_last = coefficient_table(coefficient_type, custom_coefficient_sets)
    n = len(table)
    return [table[min(i, n - 1)] if repeat_last else table[i % n] for i in range(steps)]


def get_muon_scale_factor(size_out: int, size_in: int, mode: MuonScaleT = "spectral") -> float:
    """Scale of the orthogonalized update of a (size_out, size_in) matrix.

    spectral: sqrt(max(m, n)); shape_scaling: sqrt(max(1, m/n)); unit_rms_norm: sqrt(m/n).
    """
    if mode == "spectral":
        return math.sqrt(max(size_out, size_in))
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, size_out / size_in))
    if mode == "unit_rms_norm":
        return math.sqrt(size_out / size_in)
    raise ValueError(
        f"Invalid mode for Muon update scale factor: {mode!r}; scale_mode must be one of {', '.join(SCALE_MODES)}"
    )


def resolve_precision(precision: str | None) -> str:
    """``precision``, or torch's float32 matmul precision when None (as Emerging-Optimizers'
    ``newton_schulz`` follows ``torch.get_float32_matmul_precision()``)."""
    if precision is None:
        precision = torch_matmul_precision()
    validate_precision(precision)
    return precision


def torch_matmul_precision() -> str:
    # kept out of module import: this module is importable without torch
    from ._precision import current_fp32_matmul_precision

    return current_fp32_matmul_precision()


def validate_precision(precision: str) -> None:
    if precision not in ("medium", "high", "highest"):
        raise ValueError(f"precision must be one of 'medium', 'high', 'highest', got {precision!r}")


def validate_algorithm(algorithm: str) -> None:
    """Raises ValueError naming the choices when ``algorithm`` is not a Newton–Schulz algorithm."""
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"algorithm must be one of 'auto', 'standard', 'gram', got {algorithm!r}")
