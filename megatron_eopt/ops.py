"""Typed Python wrappers over ``torch.ops.megatron_eopt`` and the fake kernel of every op.

The wrappers validate arguments with Python exceptions (TypeError / ValueError naming the
argument) before anything runs; the ops check again in C++ for direct callers (whose errors the
wrappers re-raise with the same Python types, see :mod:`megatron_eopt._errors`).
"""

from __future__ import annotations

import math
import struct
from typing import Sequence, Union

import torch

from . import _library  # noqa: F401  (loads the op library)
from ._errors import call_op
from .newton_schulz import (
    MuonScaleT,
    NSAlgorithmT,
    NSCoeffT,
    PrecisionT,
    NS_ALGORITHMS,
    NS_EPS,
    check_steps,
    coefficient_table,
    resolve_precision,
    validate_algorithm,
    validate_precision,
)
from .second_moment import Moment2MethodT, moment2_shape, validate_moment2_method

_ops = torch.ops.megatron_eopt


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


def _check_matrix(name: str, x: torch.Tensor, ranks: tuple[int, ...]) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.ndim not in ranks:
        raise TypeError(f"{name} must be {' or '.join(f'{r}-D' for r in ranks)}, got {x.ndim}-D")


def _recipe_arguments(eps_mode: str, norm_divisor: float, row_equilibration: bool,
                      frobenius_renorm: bool) -> tuple[str, float, bool, bool]:
    """The ops' trailing recipe arguments, checked (ValueError naming the argument)."""
    if eps_mode not in ("clamp", "add"):
        raise ValueError(f"eps_mode must be one of ['clamp', 'add'], got {eps_mode!r}")
    if (isinstance(norm_divisor, bool) or not isinstance(norm_divisor, (int, float))
            or not math.isfinite(norm_divisor) or norm_divisor < 1):
        raise ValueError(f"norm_divisor must be a finite number >= 1, got {norm_divisor!r}")
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
    the result of the whole matrix. ``use_syrk`` is accepted for compatibility; the op chooses its
    products itself.

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
    if not isinstance(use_syrk, bool):
        raise TypeError(f"use_syrk must be a bool, got {type(use_syrk).__name__}")
    if not isinstance(normalize_in_double, bool):
        raise TypeError(f"normalize_in_double must be a bool, got {type(normalize_in_double).__name__}")
    recipe = _recipe_arguments(eps_mode, norm_divisor, row_equilibration, frobenius_renorm)
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
    return call_op(_ops.newton_schulz, x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                   *recipe)


def _frobenius_normalize(x: torch.Tensor, eps: float, tp_group, in_double: bool) -> torch.Tensor:
    """x / ‖x‖_F per matrix (over the whole sharded matrix with ``tp_group``).

    float32: the norm clamped to ``eps``. ``in_double``: squares summed in float64 and no clamp
    (Emerging-Optimizers 0.4: a zero matrix then gives NaN, as there)."""
    xs = x.double() if in_double else x
    sq = (xs * xs).sum(dim=(-2, -1), keepdim=True)
    if tp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=tp_group)
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
        dist.all_gather(shards, x.contiguous(), group=tp_group)
        full = newton_schulz(torch.cat(shards, dim=partition_dim), steps, coefficient_type, use_syrk=use_syrk)
        return full.chunk(len(shards), dim=partition_dim)[dist.get_rank(tp_group)]
    if tp_mode == "distributed":
        if partition_dim not in (0, 1):
            raise ValueError(f"Invalid partition_dim: {partition_dim}")
        return newton_schulz(
            x, steps, coefficient_type, transpose=partition_dim == 0, tp_group=tp_group, use_syrk=use_syrk
        )
    raise ValueError(f"Invalid tp_mode: {tp_mode}")


def _tensor_parallel_newton_schulz(
    x, steps, coefficient_type, custom_coefficient_sets, eps, transpose, tp_group, precision, algorithm
) -> torch.Tensor:
    """The distributed iteration of Megatron's tp_mode "distributed" over ``tp_group`` (docs/design.md §4.9)."""
    import torch.distributed as dist

    from .optim._config import make_config
    from .optim._distributed import distributed_newton_schulz
    from .optim._plan import TPLayout

    config = make_config(
        nesterov=False,
        weight_decay_method="decoupled",
        fp32_matmul_prec=precision,
        coefficient_type=coefficient_type,
        custom_coefficient_sets=custom_coefficient_sets,
        num_ns_steps=steps,
        scale_mode="spectral",
        extra_scale_factor=1.0,
        ns_algorithm=algorithm,
    )
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    # distributed_newton_schulz contracts the sharded side: rows sharded means iterating on X^T.
    tp = TPLayout(
        group=tp_group,
        size=dist.get_world_size(tp_group),
        rank=dist.get_rank(tp_group),
        partition_dim=0 if transpose else 1,
        mode="distributed",
    )
    out = distributed_newton_schulz(x if x.ndim == 3 else x.unsqueeze(0), tp, config, eps)
    return out if x.ndim == 3 else out.squeeze(0)


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
) -> list[torch.Tensor]:
    """:func:`newton_schulz` of each 2-D matrix of ``xs``; equal shapes run as one batch (the
    recipe arguments as there)."""
    for i, x in enumerate(xs):
        _check_matrix(f"xs[{i}]", x, (2,))
    recipe = _recipe_arguments(eps_mode, norm_divisor, row_equilibration, frobenius_renorm)
    precision = resolve_precision(precision)
    coefficients, repeat_last = _ns_arguments(
        steps, coefficient_type, custom_coefficient_sets, eps, precision, algorithm
    )
    if len(xs) == 0:
        return []
    return list(
        call_op(_ops.newton_schulz_list, list(xs), coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                *recipe)
    )


WEIGHT_DECAY_METHODS = ("decoupled", "independent", "l2", "palm", "cautious")

ScalarArg = Union[float, torch.Tensor]


def _tensor_list(name: str, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(xs).__name__}")
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(x).__name__}")
    return list(xs)


# ------------------------------------------------------------------ per-step scalars
def _step_scalar(name: str, value: ScalarArg, device: torch.device, check=None) -> torch.Tensor:
    """A per-step scalar as the ops take it: a 0-dim fp32 or fp64 tensor on the lists' device.

    Tensors pass through unchanged (the op checks dtype and device; reading their value would
    synchronize, so a device tensor's value is the caller's to keep valid). Python numbers are
    checked with ``check(value) -> message | None`` and become a fresh fp64 tensor, filled on the
    device without a host sync; fp64 keeps the reference's rounding of e.g. ``1 - momentum``.
    """
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python float or a 0-dim float32/float64 tensor, got {type(value).__name__}")
    value = float(value)
    problem = check(value) if check is not None else (None if math.isfinite(value) else "must be finite")
    if problem is not None:
        raise ValueError(f"{name} {problem}, got {value}")
    return torch.full((), value, dtype=torch.float64, device=device)


def _optional_scalar(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be None or a 0-dim tensor (GradScaler's), got {type(value).__name__}")
    return value


def _float32_value(value: float) -> float:
    """value as stored in fp32 (inf when out of range, 0 when below the smallest subnormal)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_unit_interval(value: float) -> str | None:
    return None if 0.0 <= value <= 1.0 else "must be finite and in [0, 1]"


def _check_momentum(value: float) -> str | None:
    # Any finite value >= 0 (torch.optim.Muon accepts momentum >= 1; the optimizers check their own range).
    return None if 0.0 <= value < math.inf else "must be finite and >= 0"


def _check_eps(value: float) -> str | None:
    # The kernels use eps in fp32: a value that rounds to 0 or inf there is refused here.
    return None if 0.0 < _float32_value(value) < math.inf else "must be finite and positive in float32"


# ------------------------------------------------------------------ second-moment normalization
_MOMENT2_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _moment2_scalars(device, beta2, eps) -> tuple[torch.Tensor, torch.Tensor]:
    return (_step_scalar("beta2", beta2, device, _check_unit_interval), _step_scalar("eps", eps, device, _check_eps))


def _check_moment2_lists(method: str, updates, moment2, grads=None, ns_inputs=None):
    updates = _tensor_list("updates", updates)
    moment2 = _tensor_list("moment2", moment2)
    if len(moment2) != len(updates):
        raise ValueError(f"moment2 has {len(moment2)} tensors but updates has {len(updates)}")
    extra = {}
    if method == "namo":
        extra = {"grads": _tensor_list("grads", grads), "ns_inputs": _tensor_list("ns_inputs", ns_inputs)}
        for name, xs in extra.items():
            if len(xs) != len(updates):
                raise ValueError(f"{name} has {len(xs)} tensors but updates has {len(updates)}")
    for i, (u, v) in enumerate(zip(updates, moment2)):
        _check_matrix(f"updates[{i}]", u, (2,))
        if u.device != updates[0].device:
            raise ValueError(f"updates[{i}] is on {u.device} but updates[0] is on {updates[0].device}")
        if v.dtype != torch.float32:
            raise TypeError(f"moment2[{i}] must be float32, got {v.dtype}")
        if v.device != u.device:
            raise ValueError(f"moment2[{i}] is on {v.device} but updates[{i}] is on {u.device}")
        expected = moment2_shape(method, u.shape[0], u.shape[1])
        if tuple(v.shape) != expected and not (method == "namo" and v.dim() == 0):
            raise ValueError(
                f"moment2[{i}] has shape {tuple(v.shape)} but an update of shape {tuple(u.shape)} needs {expected}"
            )
        for name, xs in extra.items():
            x = xs[i]
            if x.dtype not in _MOMENT2_INPUT_DTYPES:
                raise TypeError(f"{name}[{i}] must be float32, bfloat16 or float16, got {x.dtype}")
            if x.shape != u.shape:
                raise ValueError(f"{name}[{i}] has shape {tuple(x.shape)} but updates[{i}] has shape {tuple(u.shape)}")
            if x.device != u.device:
                raise ValueError(f"{name}[{i}] is on {x.device} but updates[{i}] is on {u.device}")
    return updates, moment2, extra


def adamuon_normalize_(
    updates: Sequence[torch.Tensor],
    moment2: Sequence[torch.Tensor],
    *,
    beta2: ScalarArg = 0.95,
    eps: ScalarArg = 1e-8,
    found_inf: torch.Tensor | None = None,
) -> None:
    """AdaMuon, in place on each raw Newton–Schulz output ``O = updates[i]`` (fp32, 2-D).

    ``v <- beta2 v + (1 - beta2) O**2`` elementwise (``v = moment2[i]``, fp32, shaped like ``O``), then
    ``O <- O / (sqrt(v) + eps)``. No bias correction. Apply the Muon scale afterwards. ``beta2`` and
    ``eps`` are floats or 0-dim tensors on the lists' device; a non-zero ``found_inf`` (GradScaler)
    leaves everything untouched.
    """
    updates, moment2, _ = _check_moment2_lists("adamuon", updates, moment2)
    if updates:
        b, e = _moment2_scalars(updates[0].device, beta2, eps)
        call_op(_ops.adamuon_normalize_, updates, moment2, b, e, _optional_scalar("found_inf", found_inf))


def normuon_normalize_(
    updates: Sequence[torch.Tensor],
    moment2: Sequence[torch.Tensor],
    *,
    beta2: ScalarArg = 0.95,
    eps: ScalarArg = 1e-8,
    found_inf: torch.Tensor | None = None,
) -> None:
    """NorMuon, in place on each raw Newton–Schulz output ``O = updates[i]`` (fp32, ``(m, n)``).

    ``v = moment2[i]`` is ``(m, 1)`` when ``m >= n`` else ``(1, n)``: ``v <- beta2 v + (1 - beta2) r``
    with ``r`` the mean of ``O**2`` over the shorter side; ``U' = O * rsqrt(max(v, eps))``;
    ``O <- U' * ||O||_F / max(||U'||_F, eps)``. Scalars as in :func:`adamuon_normalize_`.
    """
    updates, moment2, _ = _check_moment2_lists("normuon", updates, moment2)
    if updates:
        b, e = _moment2_scalars(updates[0].device, beta2, eps)
        call_op(_ops.normuon_normalize_, updates, moment2, b, e, _optional_scalar("found_inf", found_inf))


def namo_normalize_(
    updates: Sequence[torch.Tensor],
    moment2: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    ns_inputs: Sequence[torch.Tensor],
    *,
    beta2: ScalarArg = 0.95,
    eps: ScalarArg = 1e-8,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """NAMO, in place on each raw Newton–Schulz output ``O = updates[i]`` (fp32, 2-D).

    ``v = moment2[i]`` is a ``(1,)`` fp32 tensor: ``v <- beta2 v + (1 - beta2) ||grads[i]||_F**2``, then
    ``O <- O * ||ns_inputs[i]||_F / (sqrt(v) + eps)``. ``grads[i]`` is the gradient (after weight decay;
    divided by ``grad_scale`` when given), ``ns_inputs[i]`` the Newton–Schulz input (momentum /
    Nesterov output); both shaped like ``O``, float32, bfloat16 or float16. Scalars as in
    :func:`adamuon_normalize_`.
    """
    updates, moment2, extra = _check_moment2_lists("namo", updates, moment2, grads, ns_inputs)
    if updates:
        b, e = _moment2_scalars(updates[0].device, beta2, eps)
        call_op(_ops.namo_normalize_, updates, moment2, extra["grads"], extra["ns_inputs"], b, e,
                             _optional_scalar("grad_scale", grad_scale), _optional_scalar("found_inf", found_inf))


def new_moment2_buffer(method: Moment2MethodT, param: torch.Tensor) -> torch.Tensor:
    """Zero second-moment state (fp32, on ``param``'s device) of a 2-D parameter for ``method``."""
    validate_moment2_method(method)
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    if param.dim() != 2:
        raise ValueError(f"param must be 2-D, got shape {tuple(param.shape)}")
    return torch.zeros(moment2_shape(method, param.shape[0], param.shape[1]), dtype=torch.float32, device=param.device)


# ------------------------------------------------------------------ split orthogonalization
def newton_schulz_split(
    x: torch.Tensor,
    split_sizes: Sequence[int],
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
) -> torch.Tensor:
    """Orthogonalizes the parts of a fused projection ``x`` (fp32, ``(rows, n)``, or a stack
    ``(batch, rows, n)`` of projections of one shape, all parts of one size in one batch) separately.

    ``x`` is viewed as ``(num_groups, sum(split_sizes), n)`` and cut along the middle dimension;
    part ``k`` is the ``(num_groups * split_sizes[k], n)`` matrix of its rows across the groups
    (Megatron's QKV layout: ``num_groups`` query groups, ``split_sizes = [q, kv, kv]`` or
    ``[q, q, kv, kv]`` with an output gate; ``num_groups=1`` gives plain row splits, e.g. fused
    gate/up, or per-head splits with ``[head_dim] * heads``). ``num_groups=None`` infers it from
    ``rows`` as Megatron does. Each part goes through :func:`newton_schulz` (equal sizes as one
    batch) and, when ``scale_mode`` is given, is multiplied by
    ``get_muon_scale_factor(part_rows, n, scale_mode) * extra_scale_factor``; ``scale_mode=None``
    returns the raw parts (AdaptiveMuon normalizes those first). ``algorithm`` as in
    :func:`newton_schulz`, chosen per part shape. The recipe arguments as in :func:`newton_schulz`,
    each part being its own matrix (MuonEq's RMS row norm and Muon+'s ``√min`` are the part's; Muon+
    comes before the part's scale). Returns a new fp32 tensor like ``x``.
    """
    _check_matrix("x", x, (2, 3))
    if isinstance(split_sizes, (int, torch.Tensor)) or not isinstance(split_sizes, Sequence):
        raise TypeError(f"split_sizes must be a sequence of ints, got {type(split_sizes).__name__}")
    sizes = [int(s) for s in split_sizes]
    if not sizes:
        raise ValueError("split_sizes must not be empty")
    for k, s in enumerate(sizes):
        if s < 1:
            raise ValueError(f"split_sizes[{k}] must be positive, got {s}")
    group_rows = sum(sizes)
    rows = x.shape[-2]
    if num_groups is None:
        if rows % group_rows != 0:
            raise ValueError(f"x has {rows} rows, which is not a multiple of sum(split_sizes) = {group_rows}")
        num_groups = rows // group_rows
    num_groups = int(num_groups)
    if num_groups < 1:
        raise ValueError(f"num_groups must be positive, got {num_groups}")
    if rows != num_groups * group_rows:
        raise ValueError(
            f"x has {rows} rows, which is not num_groups * sum(split_sizes) = {num_groups} * {group_rows}"
        )
    if scale_mode is not None and scale_mode not in ("spectral", "shape_scaling", "unit_rms_norm"):
        raise ValueError(
            f"scale_mode must be one of spectral, shape_scaling, unit_rms_norm or None; got {scale_mode!r}"
        )
    extra_scale_factor = float(extra_scale_factor)
    if not math.isfinite(extra_scale_factor):
        raise ValueError(f"extra_scale_factor must be finite, got {extra_scale_factor}")
    if scale_mode is None and extra_scale_factor != 1.0:
        raise ValueError(
            "extra_scale_factor applies only with a scale_mode; without one the parts are returned unscaled"
        )
    recipe = _recipe_arguments(eps_mode, norm_divisor, row_equilibration, frobenius_renorm)
    precision = resolve_precision(precision)
    coefficients, repeat_last = _ns_arguments(
        steps, coefficient_type, custom_coefficient_sets, eps, precision, algorithm
    )
    return call_op(_ops.newton_schulz_split,
        x, sizes, num_groups, coefficients, steps, repeat_last, eps, transpose, precision, scale_mode,
        extra_scale_factor, algorithm, *recipe,
    )

# ------------------------------------------------------------------ foreach momentum and update
def _check_weight_decay_method(method: str) -> None:
    if method not in WEIGHT_DECAY_METHODS:
        raise ValueError(f"unknown weight_decay_method {method!r}, expected one of: {', '.join(WEIGHT_DECAY_METHODS)}")


def _lists_device(*lists: Sequence[torch.Tensor]) -> torch.device | None:
    for xs in lists:
        if len(xs) > 0:
            return xs[0].device
    return None


def foreach_momentum_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    ns_inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] = (),
    *,
    momentum: ScalarArg,
    nesterov: bool,
    weight_decay: ScalarArg = 0.0,
    weight_decay_method: str = "decoupled",
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """Momentum step of the Muon family over lists of tensors, in one fused pass per call.

    For each index i (math in fp32, results stored in each tensor's dtype): ``g = grads[i]``,
    divided by ``grad_scale`` when given (GradScaler; ``grads`` itself is not modified); with
    ``weight_decay_method == "l2"``, ``g = g + weight_decay * params[i]``; then
    ``momentum_buffers[i].lerp_(g, 1 - momentum)`` and ``ns_inputs[i]`` receives the Newton–Schulz
    input: ``g.lerp(momentum_buffers[i], momentum)`` with ``nesterov``, else the new buffer. A
    non-zero ``found_inf`` leaves every tensor untouched (decided on the device, no sync).

    ``params`` is read only for l2 and may be empty otherwise; the other weight-decay methods act
    on the parameters and are applied by :func:`foreach_update_`. Gradients and parameters are
    float32, bfloat16 or float16; buffers have their dtype or float32; ``ns_inputs`` are float32 or
    bfloat16 (e.g. slices of a stacked batch for :func:`newton_schulz`). Tensors of one index may
    have different layouts (a transposed parameter). ``momentum`` and ``weight_decay`` are floats
    or 0-dim tensors on the lists' device (optimizers pass tensors, so values that change every
    step neither sync nor recompile).
    """
    grads = _tensor_list("grads", grads)
    momentum_buffers = _tensor_list("momentum_buffers", momentum_buffers)
    ns_inputs = _tensor_list("ns_inputs", ns_inputs)
    params = _tensor_list("params", params)
    _check_weight_decay_method(weight_decay_method)
    device = _lists_device(grads, momentum_buffers, ns_inputs, params)
    if device is None:
        return
    mu = _step_scalar("momentum", momentum, device, _check_momentum)
    wd = _step_scalar("weight_decay", weight_decay, device)
    call_op(_ops.foreach_momentum_, grads, momentum_buffers, ns_inputs, params, mu, bool(nesterov), wd, weight_decay_method,
                           _optional_scalar("grad_scale", grad_scale), _optional_scalar("found_inf", found_inf))


def foreach_update_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    scales: Sequence[float],
    *,
    lr: ScalarArg,
    weight_decay: ScalarArg = 0.0,
    weight_decay_method: str = "decoupled",
    found_inf: torch.Tensor | None = None,
) -> None:
    """Weight decay and update of the parameters over lists of tensors, in one fused pass per call.

    For each index i: ``params[i] <- params[i] - f * params[i] - lr * scales[i] * updates[i]`` with
    ``f = lr * weight_decay`` (decoupled), ``weight_decay`` (independent), ``lr**2 * weight_decay``
    (palm) or 0 (l2: the decay went into the gradient in :func:`foreach_momentum_`); evaluated as
    the reference does, decay first (stored in the parameter's dtype), then the update, in fp32.
    ``"cautious"`` (Chen et al., "Cautious Weight Decay", 2025) is decoupled decay only where
    ``updates[i] * params[i] >= 0``, the mask read from the update as given (before its scale, so a
    scale of 0 applies the masked decay alone) and the parameter before the decay, with the
    numerics of ``p.sub_(p * (u * p >= 0) * f.to(p.dtype))`` in PyTorch.
    ``updates`` are float32 or the parameters' dtype; ``lr`` and ``weight_decay`` are floats or
    0-dim tensors (optimizers pass tensors, so a changing lr neither syncs nor recompiles). A
    non-zero ``found_inf`` leaves the parameters untouched.
    """
    params = _tensor_list("params", params)
    updates = _tensor_list("updates", updates)
    if isinstance(scales, torch.Tensor) or not isinstance(scales, (list, tuple)):
        raise TypeError(f"scales must be a list or tuple of floats, got {type(scales).__name__}")
    scale_values = []
    for i, s in enumerate(scales):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(f"scales[{i}] must be a float, got {type(s).__name__}")
        if not math.isfinite(s):
            raise ValueError(f"scales[{i}] must be finite, got {s}")
        scale_values.append(float(s))
    _check_weight_decay_method(weight_decay_method)
    device = _lists_device(params, updates)
    if device is None:
        if len(scale_values) != 0:
            raise ValueError(f"scales has {len(scale_values)} values but no params were given")
        return
    lr_t = _step_scalar("lr", lr, device)
    wd = _step_scalar("weight_decay", weight_decay, device)
    call_op(_ops.foreach_update_, params, updates, scale_values, lr_t, wd, weight_decay_method,
                         _optional_scalar("found_inf", found_inf))


# ------------------------------------------------------------------ QK-clip
def qk_clip_(weights: Sequence[torch.Tensor], factors: Sequence[torch.Tensor], block_rows: Sequence[int]) -> None:
    """Scales row blocks of attention weights in place, every weight in one pass (QK-clip).

    ``weights[i]`` (``(rows, cols)``, float32 / bfloat16 / float16, rows contiguous; one dtype and one
    device for all) is cut into blocks of ``block_rows[i]`` rows (one attention head each); block
    ``b`` is multiplied by ``factors[i][b]`` (a float32 vector of ``rows // block_rows[i]`` values on
    the weight's device), in fp32 and stored in the weight's dtype. See ``megatron_eopt.optim.qk_clip``
    for the factors.
    """
    weights = _tensor_list("weights", weights)
    factors = _tensor_list("factors", factors)
    if isinstance(block_rows, (int, torch.Tensor)) or not isinstance(block_rows, Sequence):
        raise TypeError(f"block_rows must be a list of ints, got {type(block_rows).__name__}")
    rows = []
    for i, b in enumerate(block_rows):
        if isinstance(b, bool) or not isinstance(b, int):
            raise TypeError(f"block_rows[{i}] must be an int, got {type(b).__name__}")
        rows.append(b)
    if weights or factors or rows:
        call_op(_ops.qk_clip_, weights, factors, rows)


@torch.library.register_fake("megatron_eopt::qk_clip_")
def _qk_clip_fake(weights, factors, block_rows):
    op = "qk_clip_"
    torch._check_value(len(factors) == len(weights) and len(block_rows) == len(weights),
                       lambda: f"{op}: weights, factors and block_rows differ in length")
    _fake_list_dtype(op, "weights", weights, _PARAM_FLOATS)
    for i, (w, f, b) in enumerate(zip(weights, factors, block_rows)):
        torch._check_value(w.dim() == 2, lambda: f"{op}: weights[{i}] must be 2-D")
        torch._check_value(b >= 1 and w.shape[0] % b == 0, lambda: f"{op}: block_rows[{i}] must divide the rows")
        torch._check_type(f.dtype == torch.float32, lambda: f"{op}: factors[{i}] must be float32")
        torch._check_value(f.dim() == 1 and f.shape[0] == w.shape[0] // b,
                           lambda: f"{op}: factors[{i}] must have one value per block of rows")
    return None


# ------------------------------------------------------------------ fake kernels
def _fake_check_algorithm(algorithm) -> None:
    torch._check_value(algorithm in NS_ALGORITHMS,
                       lambda: f"algorithm must be one of 'auto', 'standard', 'gram', got {algorithm!r}")


def _fake_check_recipe(eps_mode, norm_divisor) -> None:
    torch._check_value(eps_mode in ("clamp", "add"), lambda: f"eps_mode must be one of clamp, add; got {eps_mode!r}")
    torch._check_value(math.isfinite(norm_divisor) and norm_divisor >= 1,
                       lambda: f"norm_divisor must be finite and at least 1, got {norm_divisor}")


@torch.library.register_fake("megatron_eopt::newton_schulz")
def _newton_schulz_fake(x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                        eps_mode="clamp", norm_divisor=1.0, row_equilibration=False, frobenius_renorm=False):
    torch._check(x.dtype == torch.float32, lambda: f"x must be float32, got {x.dtype}")
    torch._check(x.dim() in (2, 3), lambda: f"x must be 2-D or 3-D, got {x.dim()}-D")
    _fake_check_algorithm(algorithm)
    _fake_check_recipe(eps_mode, norm_divisor)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("megatron_eopt::newton_schulz_list")
def _newton_schulz_list_fake(xs, coefficients, steps, repeat_last, eps, transpose, precision, algorithm,
                             eps_mode="clamp", norm_divisor=1.0, row_equilibration=False, frobenius_renorm=False):
    _fake_check_algorithm(algorithm)
    _fake_check_recipe(eps_mode, norm_divisor)
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


def _moment2_fake_checks(updates, moment2):
    torch._check(len(moment2) == len(updates), lambda: "moment2 and updates differ in length")
    for u, v in zip(updates, moment2):
        torch._check(u.dtype == torch.float32 and u.dim() == 2, lambda: "updates must be 2-D float32")
        torch._check(v.dtype == torch.float32, lambda: "moment2 must be float32")


@torch.library.register_fake("megatron_eopt::adamuon_normalize_")
def _adamuon_normalize_fake(updates, moment2, beta2, eps, found_inf=None):
    _moment2_fake_checks(updates, moment2)
    _fake_check_scalar("adamuon_normalize_", "beta2", beta2)
    _fake_check_scalar("adamuon_normalize_", "eps", eps)


@torch.library.register_fake("megatron_eopt::normuon_normalize_")
def _normuon_normalize_fake(updates, moment2, beta2, eps, found_inf=None):
    _moment2_fake_checks(updates, moment2)
    _fake_check_scalar("normuon_normalize_", "beta2", beta2)
    _fake_check_scalar("normuon_normalize_", "eps", eps)


@torch.library.register_fake("megatron_eopt::namo_normalize_")
def _namo_normalize_fake(updates, moment2, grads, ns_inputs, beta2, eps, grad_scale=None, found_inf=None):
    _moment2_fake_checks(updates, moment2)
    torch._check(len(grads) == len(updates) and len(ns_inputs) == len(updates),
                 lambda: "grads, ns_inputs and updates differ in length")
    _fake_check_scalar("namo_normalize_", "beta2", beta2)
    _fake_check_scalar("namo_normalize_", "eps", eps)


@torch.library.register_fake("megatron_eopt::newton_schulz_split")
def _newton_schulz_split_fake(x, split_sizes, num_groups, coefficients, steps, repeat_last, eps, transpose,
                              precision, scale_mode, extra_scale_factor, algorithm, eps_mode="clamp",
                              norm_divisor=1.0, row_equilibration=False, frobenius_renorm=False):
    _fake_check_algorithm(algorithm)
    _fake_check_recipe(eps_mode, norm_divisor)
    torch._check(x.dtype == torch.float32, lambda: f"x must be float32, got {x.dtype}")
    torch._check(x.dim() in (2, 3), lambda: f"x must be 2-D or 3-D, got {x.dim()}-D")
    torch._check(x.shape[-2] == num_groups * sum(split_sizes),
                 lambda: "x rows must equal num_groups * sum(split_sizes)")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_list_dtype(op: str, name: str, xs, allowed) -> torch.dtype | None:
    dtype = None
    for i, x in enumerate(xs):
        torch._check_type(x.dtype in allowed, lambda: f"{op}: {name}[{i}] is {x.dtype}; expected one of {allowed}")
        dtype = dtype or x.dtype
        torch._check_type(x.dtype == dtype, lambda: f"{op}: all {name} must share one dtype")
    return dtype


def _fake_check_index(op: str, i: int, ref_name: str, ref: torch.Tensor, others) -> None:
    for name, xs in others:
        if len(xs) > 0:
            torch._check_value(xs[i].shape == ref.shape,
                               lambda: f"{op}: {name}[{i}] has shape {tuple(xs[i].shape)} but {ref_name}[{i}] "
                                       f"has shape {tuple(ref.shape)}")


def _fake_check_scalar(op: str, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    torch._check_value(t.dim() == 0, lambda: f"{op}: {name} must be a 0-dim float32 or float64 tensor")
    torch._check_type(t.dtype in (torch.float32, torch.float64),
                      lambda: f"{op}: {name} must be a 0-dim float32 or float64 tensor")


_FLOATS = (torch.float32, torch.bfloat16)
_PARAM_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@torch.library.register_fake("megatron_eopt::foreach_momentum_")
def _foreach_momentum_fake(grads, momentum_buffers, ns_inputs, params, momentum, nesterov, weight_decay,
                           weight_decay_method, grad_scale=None, found_inf=None):
    op = "foreach_momentum_"
    torch._check_value(weight_decay_method in WEIGHT_DECAY_METHODS,
                       lambda: f"{op}: unknown weight_decay_method {weight_decay_method!r}")
    n = len(grads)
    torch._check_value(len(momentum_buffers) == n and len(ns_inputs) == n, lambda: f"{op}: list lengths differ")
    torch._check_value(len(params) == n or (len(params) == 0 and weight_decay_method != "l2"),
                       lambda: f"{op}: params must be empty or have one tensor per gradient (l2: required)")
    grad_dtype = _fake_list_dtype(op, "grads", grads, _PARAM_FLOATS)
    if grad_dtype is not None:
        _fake_list_dtype(op, "params", params, (grad_dtype,))
        _fake_list_dtype(op, "momentum_buffers", momentum_buffers, tuple({grad_dtype, torch.float32}))
    _fake_list_dtype(op, "ns_inputs", ns_inputs, _FLOATS)
    for name, t in (("momentum", momentum), ("weight_decay", weight_decay), ("grad_scale", grad_scale),
                    ("found_inf", found_inf)):
        _fake_check_scalar(op, name, t)
    for i in range(n):
        _fake_check_index(op, i, "grads", grads[i],
                          (("momentum_buffers", momentum_buffers), ("ns_inputs", ns_inputs), ("params", params)))
    return None


@torch.library.register_fake("megatron_eopt::foreach_update_")
def _foreach_update_fake(params, updates, scales, lr, weight_decay, weight_decay_method, found_inf=None):
    op = "foreach_update_"
    torch._check_value(weight_decay_method in WEIGHT_DECAY_METHODS,
                       lambda: f"{op}: unknown weight_decay_method {weight_decay_method!r}")
    n = len(params)
    torch._check_value(len(updates) == n and len(scales) == n, lambda: f"{op}: list lengths differ")
    torch._check_value(all(math.isfinite(s) for s in scales), lambda: f"{op}: scales must be finite")
    param_dtype = _fake_list_dtype(op, "params", params, _PARAM_FLOATS)
    if param_dtype is not None:
        _fake_list_dtype(op, "updates", updates, tuple({param_dtype, torch.float32}))
    for name, t in (("lr", lr), ("weight_decay", weight_decay), ("found_inf", found_inf)):
        _fake_check_scalar(op, name, t)
    for i in range(n):
        _fake_check_index(op, i, "params", params[i], (("updates", updates),))
    return None


# The low-memory state ops live beside the formats they store (see low_memory_state).
from .low_memory_state import adamuon_normalize_quantized_, foreach_momentum_quantized_  # noqa: E402,F401
