"""Newton–Schulz orthogonalization: whole matrices, lists, split (QKV) projections and the
tensor-parallel entry; the wrappers, their argument checks and the fake kernels."""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch

from .. import _collectives as collectives
from .._errors import call_op
from ..step_stats import count_newton_schulz, count_split_newton_schulz
from ..coefficients import (
    MuonScaleT,
    NSAlgorithmT,
    NSCoeffT,
    PrecisionT,
    EPS_MODES,
    NS_ALGORITHMS,
    NS_EPS,
    NS_PRODUCTS,
    NSProductsT,
    SCALE_MODES,
    check_steps,
    coefficient_table,
    resolve_precision,
    validate_algorithm,
    validate_precision,
)
from ._checks import _check_matrix, _ops
from ._distributed import _tensor_parallel_newton_schulz


def _flatten(rows: Sequence[Sequence[float]]) -> list[float]:
    return [float(v) for row in rows for v in row]


def _ns_arguments(
    steps: int,
    coefficient_type: str,
    custom_coefficient_sets: Sequence[Sequence[float]] | None,
    eps: float,
    precision: str,
    algorithm: str,
) -> tuple[list[float], bool]:
    check_steps(coefficient_type, steps)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    validate_precision(precision)
    validate_algorithm(algorithm)
    table, repeat_last = coefficient_table(coefficient_type, custom_coefficient_sets)
    return _flatten(table), repeat_last



def recipe_arguments(eps_mode: str, norm_divisor: float, row_equilibration: bool, frobenius_renorm: bool,
                     prefix: str = "") -> tuple[str, float, bool, bool]:
    """The ops' trailing recipe arguments, checked (ValueError naming the argument: ``prefix`` and its
    name here; the optimizers call them ``ns_eps_mode`` and ``ns_norm_divisor``)."""
    if eps_mode not in EPS_MODES:
        raise ValueError(f"{prefix}eps_mode must be one of {list(EPS_MODES)}, got {eps_mode!r}")
    if (isinstance(norm_divisor, bool) or not isinstance(norm_divisor, (int, float))
            or not math.isfinite(norm_divisor) or norm_divisor < 1):
        raise ValueError(f"{prefix}norm_divisor must be a finite number >= 1, got {norm_divisor!r}")
    for name, flag in (("row_equilibration", row_equilibration), ("frobenius_renorm", frobenius_renorm)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    return eps_mode, float(norm_divisor), row_equilibration, frobenius_renorm


_DEFAULT_RECIPE = ("clamp", 1.0, False, False)


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficient_type: NSCoeffT = "quintic",
    custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
    eps: float = NS_EPS,
    transpose: bool | None = None,
    tp_group: "torch.distributed.ProcessGroup | None" = None,
    use_syrk: bool = False,
    normalize_in_double: bool = False,
    *,
    precision: PrecisionT | None = None,
    algorithm: NSAlgorithmT = "auto",
    eps_mode: str = "clamp",
    norm_divisor: float = 1.0,
    row_equilibration: bool = False,
    frobenius_renorm: bool = False,
    products: NSProductsT = "auto",
) -> torch.Tensor:
    """Orthogonalizes ``x`` (fp32, ``(m, n)`` or ``(batch, m, n)``) by Newton–Schulz iteration.

    Emerging-Optimizers 0.4's signature and positional order. Each matrix is normalized by its
    Frobenius norm (clamped to ``eps``; with ``normalize_in_double`` the norm is reduced in float64
    and not clamped, so inputs whose squares underflow float32 still normalize), then ``steps`` rows
    of the coefficient schedule are applied in the compute ``precision`` ("medium": bf16 storage
    with fp32 accumulation, "high": TF32, "highest": fp32; None, the default: whatever
    ``torch.get_float32_matmul_precision()`` says, as Emerging-Optimizers does). ``steps=0``
    returns the normalized input (rounded through bf16 under "medium", as the reference does).
    Tall matrices are iterated transposed unless ``transpose`` says otherwise.
    ``algorithm``: "standard" iterates on X; "gram" runs the same iteration on the Gram matrix of
    the short side, with restarts chosen for the schedule and precision (fewer FLOPs for
    rectangular matrices); "auto" (default) takes gram where it does less work on this device, else
    standard. Returns an fp32 tensor shaped like ``x``.

    ``eps`` defaults to 0.4's 1e-15; pass ``eps=1e-7`` for Emerging-Optimizers 0.3.0's numerics.

    With ``tp_group``, ``x`` is this rank's shard of a matrix split over the group along the side
    the iteration contracts (the columns, or the rows when transposed), as in Emerging-Optimizers:
    the norm and every Gram product are all-reduced over the group, so each rank gets its shard of
    the result of the whole matrix. ``products`` (keyword-only): how the symmetric products run,
    "auto" (measured, or the process-wide setting), "symmetric" (the symmetric kernel or lower block
    panels where the side allows) or "full" (one GEMM each); ``use_syrk=True`` (Emerging-Optimizers'
    switch for its SYRK kernel) is ``products="symmetric"``. The results agree to float rounding.

    The 2026 recipe (keyword-only, inside the op: no extra pass over ``x``; see ``NSRecipe`` in
    :mod:`megatron_eopt.optim._recipe`): ``eps_mode="add"`` divides by ``‖x‖ + eps`` instead of
    ``max(‖x‖, eps)``; ``norm_divisor`` s ≥ 1 multiplies that denominator (Polar Express's safety
    factor); ``row_equilibration`` rescales every row to the RMS row norm first (MuonEq);
    ``frobenius_renorm`` sets each result's Frobenius norm to ``√min(m, n)`` (Muon+). Not with
    ``tp_group``, ``normalize_in_double`` or ``steps=0``.
    """
    if isinstance(x, torch.Tensor) and x.ndim not in (2, 3):  # Emerging-Optimizers' wording
        raise TypeError(f"Input tensor x must be 2d or 3d (batched 2d), got {x.ndim}d")
    _check_matrix("x", x, (2, 3))
    if isinstance(tp_group, str):
        raise TypeError(
            "newton_schulz: the 7th positional argument is tp_group (Emerging-Optimizers' order); pass "
            f"precision={tp_group!r} as a keyword"
        )
    products = resolve_products(products, use_syrk)
    if not isinstance(normalize_in_double, bool):
        raise TypeError(f"normalize_in_double must be a bool, got {type(normalize_in_double).__name__}")
    recipe = recipe_arguments(eps_mode, norm_divisor, row_equilibration, frobenius_renorm)
    if recipe != _DEFAULT_RECIPE and (tp_group is not None or normalize_in_double or steps == 0):
        raise ValueError("eps_mode, norm_divisor, row_equilibration and frobenius_renorm do not apply with "
                         "tp_group, normalize_in_double or steps=0")
    precision = resolve_precision(precision)
    coefficients, repeat_last = _ns_arguments(
        steps, coefficient_type, custom_coefficient_sets, eps, precision, algorithm
    )
    if use_syrk and x.ndim > 2 and precision == "medium":
        # Emerging-Optimizers 0.4 refuses this pair where its bf16 path would take the SYRK kernel
        # (its other precisions ignore use_syrk): the same error, type and first sentence.
        raise TypeError(f"use_syrk does not support N-d input. x has shape {tuple(x.shape)}: pass a 2-D matrix, "
                        "or use_syrk=False for a batch")
    if normalize_in_double or steps == 0:
        x = _frobenius_normalize(x, eps, tp_group, normalize_in_double)
        if steps == 0:
            # the reference stores the iterate in bf16 under "medium" before casting back
            return x.to(torch.bfloat16).to(torch.float32) if precision == "medium" else x
        # x now has unit norm: the op's own normalization changes it by float32 rounding only
    if tp_group is not None:
        return _tensor_parallel_newton_schulz(
            x, steps, coefficient_type, custom_coefficient_sets, eps, transpose, tp_group, precision, algorithm
        )
    count_newton_schulz(x.shape, steps)
    return call_op(_ops.newton_schulz, x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                   *recipe, products)


def resolve_products(products: str, use_syrk: bool = False, name: str = "products") -> str:
    """The ops' ``products`` argument from ``products`` (the argument ``name``) and
    Emerging-Optimizers' ``use_syrk`` (True: "symmetric"); ValueError / TypeError naming the argument."""
    if not isinstance(use_syrk, bool):
        raise TypeError(f"use_syrk must be a bool, got {type(use_syrk).__name__}")
    if products not in NS_PRODUCTS:
        raise ValueError(f"{name} must be one of {', '.join(NS_PRODUCTS)}; got {products!r}")
    if use_syrk:
        if products == "full":
            raise ValueError(f"use_syrk=True asks for symmetric products and {name}='full' for full GEMMs: pass one")
        return "symmetric"
    return products


def _frobenius_normalize(x: torch.Tensor, eps: float, tp_group, in_double: bool) -> torch.Tensor:
    """x / ‖x‖_F per matrix (over the whole sharded matrix with ``tp_group``).

    float32: the norm clamped to ``eps``. ``in_double``: squares summed in float64 and no clamp
    (Emerging-Optimizers 0.4: a zero matrix then gives NaN, as there)."""
    xs = x.double() if in_double else x
    sq = (xs * xs).sum(dim=(-2, -1), keepdim=True)
    if tp_group is not None:
        collectives.all_reduce(sq, group=tp_group)
    norm = sq.sqrt().to(x.dtype)
    return x / (norm if in_double else norm.clamp_min(eps))


def newton_schulz_tp(
    x: torch.Tensor,
    steps: int,
    coefficient_type: NSCoeffT,
    tp_group: "torch.distributed.ProcessGroup",
    partition_dim: int | None = None,
    tp_mode: str = "duplicated",
    use_syrk: bool = False,
) -> torch.Tensor:
    """Emerging-Optimizers' tensor-parallel Newton–Schulz of this rank's shard ``x``.

    ``partition_dim`` None: ``x`` is not sharded (plain :func:`newton_schulz`). "duplicated":
    all-gather the shards along ``partition_dim``, orthogonalize the whole matrix, keep this
    rank's chunk. "distributed": ``x`` stays sharded; the norm and Gram products are all-reduced
    (``partition_dim`` 0 iterates on the transpose). Precision follows torch's float32 matmul
    precision, eps the default.
    """
    if partition_dim is None:
        return newton_schulz(x, steps, coefficient_type, use_syrk=use_syrk)
    if tp_mode == "duplicated":
        import torch.distributed as dist

        shards = [torch.empty_like(x) for _ in range(dist.get_world_size(tp_group))]
        collectives.all_gather(shards, x.contiguous(), group=tp_group)
        full = newton_schulz(torch.cat(shards, dim=partition_dim), steps, coefficient_type, use_syrk=use_syrk)
        return full.chunk(len(shards), dim=partition_dim)[dist.get_rank(tp_group)]
    if tp_mode == "distributed":
        if partition_dim not in (0, 1):
            raise ValueError(f"Invalid partition_dim: {partition_dim}")
        return newton_schulz(
            x, steps, coefficient_type, transpose=partition_dim == 0, tp_group=tp_group, use_syrk=use_syrk
        )
    raise ValueError(f"Invalid tp_mode: {tp_mode}")


def newton_schulz_list(
    xs: Sequence[torch.Tensor],
    steps: int = 5,
    coefficient_type: NSCoeffT = "quintic",
    custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
    eps: float = NS_EPS,
    transpose: bool | None = None,
    precision: PrecisionT | None = None,
    algorithm: NSAlgorithmT = "auto",
    *,
    eps_mode: str = "clamp",
    norm_divisor: float = 1.0,
    row_equilibration: bool = False,
    frobenius_renorm: bool = False,
    products: NSProductsT = "auto",
) -> list[torch.Tensor]:
    """:func:`newton_schulz` of each 2-D matrix of ``xs``; equal shapes run as one batch (the
    recipe arguments and ``products`` as there)."""
    for i, x in enumerate(xs):
        _check_matrix(f"xs[{i}]", x, (2,))
    recipe = recipe_arguments(eps_mode, norm_divisor, row_equilibration, frobenius_renorm)
    precision = resolve_precision(precision)
    coefficients, repeat_last = _ns_arguments(
        steps, coefficient_type, custom_coefficient_sets, eps, precision, algorithm
    )
    if len(xs) == 0:
        return []
    for x in xs:
        count_newton_schulz(x.shape, steps)
    return list(
        call_op(_ops.newton_schulz_list, list(xs), coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                *recipe, resolve_products(products))
    )


# ------------------------------------------------------------------ split orthogonalization
def split_newton_schulz_op(x, split_shapes, num_groups: int, coefficients, steps: int, repeat_last: bool, eps: float,
                           transpose, precision: str, scale_mode, extra_scale_factor: float, algorithm: str, recipe,
                           products: str) -> torch.Tensor:
    """The one place that calls ``torch.ops.megatron_eopt.newton_schulz_split`` (its argument order,
    and the step statistics' count): :func:`newton_schulz_split` after its checks, and the optimizers'
    configuration (``optim/_config.py``) with its resolved table. ``recipe``: the four recipe
    arguments (:func:`recipe_arguments`); ``products``: resolved."""
    count_split_newton_schulz(x.shape, split_shapes, num_groups, steps)
    return call_op(_ops.newton_schulz_split, x, list(split_shapes), num_groups, coefficients, steps, repeat_last, eps,
                   transpose, precision, scale_mode, extra_scale_factor, algorithm, *recipe, products)


def newton_schulz_split(
    x: torch.Tensor,
    split_shapes: Sequence[int] | None = None,
    num_groups: int | None = 1,
    *,
    steps: int = 5,
    coefficient_type: NSCoeffT = "quintic",
    custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
    eps: float = NS_EPS,
    transpose: bool | None = None,
    precision: PrecisionT | None = None,
    scale_mode: MuonScaleT | None = "spectral",
    extra_scale_factor: float = 1.0,
    algorithm: NSAlgorithmT = "auto",
    eps_mode: str = "clamp",
    norm_divisor: float = 1.0,
    row_equilibration: bool = False,
    frobenius_renorm: bool = False,
    products: NSProductsT = "auto",
    split_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Orthogonalizes the parts of a fused projection ``x`` (fp32, ``(rows, n)``, or a stack
    ``(batch, rows, n)`` of projections of one shape, all parts of one size in one batch) separately.

    ``x`` is viewed as ``(num_groups, sum(split_shapes), n)`` and cut along the middle dimension;
    part ``k`` is the ``(num_groups * split_shapes[k], n)`` matrix of its rows across the groups
    (Megatron's QKV layout: ``num_groups`` query groups, ``split_shapes = [q, kv, kv]`` or
    ``[q, q, kv, kv]`` with an output gate; ``num_groups=1`` gives plain row splits, e.g. fused
    gate/up, or per-head splits with ``[head_dim] * heads``). ``num_groups=None`` infers it from
    ``rows`` as Megatron does. Each part goes through :func:`newton_schulz` (equal sizes as one
    batch) and, when ``scale_mode`` is given, is multiplied by
    ``get_muon_scale_factor(part_rows, n, scale_mode) * extra_scale_factor``; ``scale_mode=None``
    returns the raw parts (AdaptiveMuon normalizes those first). ``algorithm`` as in
    :func:`newton_schulz`, chosen per part shape. The recipe arguments as in :func:`newton_schulz`,
    each part being its own matrix (MuonEq's RMS row norm and Muon+'s ``√min`` are the part's; Muon+
    comes before the part's scale). ``products`` as in :func:`newton_schulz`. Returns a new fp32
    tensor like ``x``.
    """
    _check_matrix("x", x, (2, 3))
    if split_sizes is not None:  # the name before 0.2: the op's schema keeps it
        if split_shapes is not None:
            raise TypeError("newton_schulz_split got both split_shapes and split_sizes (its old name): pass one")
        warnings.warn("newton_schulz_split(split_sizes=...) is deprecated: the argument is split_shapes",
                      DeprecationWarning, stacklevel=2)
        split_shapes = split_sizes
    if split_shapes is None:
        raise TypeError("newton_schulz_split() missing required argument: 'split_shapes'")
    if isinstance(split_shapes, (int, torch.Tensor)) or not isinstance(split_shapes, Sequence):
        raise TypeError(f"split_shapes must be a sequence of ints, got {type(split_shapes).__name__}")
    sizes = [int(s) for s in split_shapes]
    if not sizes:
        raise ValueError("split_shapes must not be empty")
    for k, s in enumerate(sizes):
        if s < 1:
            raise ValueError(f"split_shapes[{k}] must be positive, got {s}")
    group_rows = sum(sizes)
    rows = x.shape[-2]
    if num_groups is None:
        if rows % group_rows != 0:
            raise ValueError(f"x has {rows} rows, which is not a multiple of sum(split_shapes) = {group_rows}")
        num_groups = rows // group_rows
    num_groups = int(num_groups)
    if num_groups < 1:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    if rows != num_groups * group_rows:
        raise ValueError(
            f"x has {rows} rows, which is not num_groups * sum(split_shapes) = {num_groups} * {group_rows}"
        )
    if scale_mode is not None and scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {', '.join(SCALE_MODES)} or None; got {scale_mode!r}")
    extra_scale_factor = float(extra_scale_factor)
    if not math.isfinite(extra_scale_factor):
        raise ValueError(f"extra_scale_factor must be finite, got {extra_scale_factor}")
    if scale_mode is None and extra_scale_factor != 1.0:
        raise ValueError(
            "extra_scale_factor applies only with a scale_mode; without one the parts are returned unscaled"
        )
    recipe = recipe_arguments(eps_mode, norm_divisor, row_equilibration, frobenius_renorm)
    precision = resolve_precision(precision)
    coefficients, repeat_last = _ns_arguments(
        steps, coefficient_type, custom_coefficient_sets, eps, precision, algorithm
    )
    return split_newton_schulz_op(x, sizes, num_groups, coefficients, steps, repeat_last, eps, transpose, precision,
                                  scale_mode, extra_scale_factor, algorithm, recipe, resolve_products(products))


# ------------------------------------------------------------------ fake kernels
def _fake_check_algorithm(algorithm) -> None:
    torch._check_value(algorithm in NS_ALGORITHMS,
                       lambda: f"algorithm must be one of 'auto', 'standard', 'gram', got {algorithm!r}")


def _fake_check_products(products) -> None:
    torch._check_value(products in NS_PRODUCTS,
                       lambda: f"products must be one of auto, symmetric, full; got {products!r}")


def _fake_check_recipe(eps_mode, norm_divisor) -> None:
    torch._check_value(eps_mode in EPS_MODES, lambda: f"eps_mode must be one of clamp, add; got {eps_mode!r}")
    torch._check_value(math.isfinite(norm_divisor) and norm_divisor >= 1,
                       lambda: f"norm_divisor must be finite and at least 1, got {norm_divisor}")


@torch.library.register_fake("megatron_eopt::newton_schulz")
def _newton_schulz_fake(x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                        eps_mode="clamp", norm_divisor=1.0, row_equilibration=False, frobenius_renorm=False,
                        products="auto"):
    torch._check(x.dtype == torch.float32, lambda: f"x must be float32, got {x.dtype}")
    torch._check(x.dim() in (2, 3), lambda: f"x must be 2-D or 3-D, got {x.dim()}-D")
    _fake_check_algorithm(algorithm)
    _fake_check_recipe(eps_mode, norm_divisor)
    _fake_check_products(products)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_eopt::newton_schulz_")
def _newton_schulz_inplace_fake(x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                                eps_mode="clamp", norm_divisor=1.0, row_equilibration=False, frobenius_renorm=False,
                                products="auto"):
    torch._check(x.dtype == torch.float32, lambda: f"x must be float32, got {x.dtype}")
    torch._check(x.dim() in (2, 3), lambda: f"x must be 2-D or 3-D, got {x.dim()}-D")
    torch._check(x.is_contiguous(), lambda: "newton_schulz_: x must be contiguous")
    _fake_check_algorithm(algorithm)
    _fake_check_recipe(eps_mode, norm_divisor)
    _fake_check_products(products)


@torch.library.register_fake("megatron_eopt::newton_schulz_list")
def _newton_schulz_list_fake(xs, coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                             eps_mode="clamp", norm_divisor=1.0, row_equilibration=False, frobenius_renorm=False,
                             products="auto"):
    _fake_check_algorithm(algorithm)
    _fake_check_recipe(eps_mode, norm_divisor)
    _fake_check_products(products)
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]



@torch.library.register_fake("megatron_eopt::newton_schulz_split")
def _newton_schulz_split_fake(x, split_sizes, num_groups, coefficients, steps, repeat_last, eps, transpose,
                              precision, scale_mode, extra_scale_factor, algorithm, eps_mode="clamp",
                              norm_divisor=1.0, row_equilibration=False, frobenius_renorm=False, products="auto"):
    _fake_check_algorithm(algorithm)
    _fake_check_recipe(eps_mode, norm_divisor)
    _fake_check_products(products)
    torch._check(x.dtype == torch.float32, lambda: f"x must be float32, got {x.dtype}")
    torch._check(x.dim() in (2, 3), lambda: f"x must be 2-D or 3-D, got {x.dim()}-D")
    torch._check(x.shape[-2] == num_groups * sum(split_sizes),
                 lambda: "x rows must equal num_groups * sum(split_sizes)")
    return torch.empty_like(x, memory_format=torch.contiguous_format)
