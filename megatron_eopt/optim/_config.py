"""Validated optimizer-wide settings of the Muon family (what Emerging-Optimizers keeps on the instance).

Checked once at construction, so a bad value raises before any parameter or state is touched.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from numbers import Real
from typing import Sequence

import torch

from .._errors import call_op
from ._recipe import NSRecipe, polar_express_rows
from ..coefficients import (
    NS_ALGORITHMS,
    NS_EPS,
    SCALE_MODES,
    check_steps,
    coefficient_table,
    get_muon_scale_factor,
    validate_precision,
)
from ..ops._constants import WEIGHT_DECAY_METHODS
from ..second_moment import MOMENT2_METHODS
from ..step_stats import count_newton_schulz
from ..ops._newton_schulz import resolve_products, split_newton_schulz_op


@dataclass(frozen=True)
class OrthogonalizationConfig:
    """How updates are orthogonalized and scaled; shared by every parameter of one optimizer.

    The Newton–Schulz schedule is expanded and flattened once here, so a step hands the ops
    ready-made arguments instead of rebuilding them per call.
    """

    nesterov: bool
    weight_decay_method: str
    precision: str
    coefficient_type: str
    custom_coefficient_sets: tuple[tuple[float, float, float], ...] | None
    num_ns_steps: int
    scale_mode: str
    extra_scale_factor: float
    moment2_method: str | None  # None: plain Muon (no second moment)
    algorithm: str = "auto"  # Newton–Schulz algorithm: auto | standard | gram
    ns_eps: float = NS_EPS  # Frobenius-normalization floor (EO 0.4: 1e-15; EO 0.3.0 / Megatron-LM: 1e-7)
    coefficients: tuple[tuple[float, float, float], ...] = ()  # the rows one run consumes
    table: tuple[float, ...] = ()  # the op's flattened coefficient table
    repeat_last: bool = False  # the op's schedule policy past the table
    recipe: NSRecipe = NSRecipe()  # MuonEq, normalization convention, Muon+ (see _recipe)
    products: str = "auto"  # how the ops run their symmetric products (auto | symmetric | full)

    def newton_schulz(self, x: torch.Tensor) -> torch.Tensor:
        """Newton–Schulz of a (k, m, n) or (m, n) fp32 batch with this configuration (raw, unscaled);
        the recipe (MuonEq, normalization convention and divisor, Muon+) runs inside the op."""
        count_newton_schulz(x.shape, self.num_ns_steps)
        r = self.recipe
        return call_op(
            torch.ops.megatron_eopt.newton_schulz, x, self.table, self.num_ns_steps, self.repeat_last, r.eps, None,
            self.precision, self.algorithm, *r.op_arguments, self.products,
        )

    def newton_schulz_(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`newton_schulz` in place: ``x`` (contiguous) becomes its result, which takes the
        input's memory instead of a tensor of its own. Returns ``x``."""
        count_newton_schulz(x.shape, self.num_ns_steps)
        r = self.recipe
        call_op(
            torch.ops.megatron_eopt.newton_schulz_, x, self.table, self.num_ns_steps, self.repeat_last, r.eps, None,
            self.precision, self.algorithm, *r.op_arguments, self.products,
        )
        return x

    def newton_schulz_split(self, x: torch.Tensor, sizes, num_groups: int, scaled: bool) -> torch.Tensor:
        """Split Newton–Schulz of one fused (rows, n) projection; parts scaled for Muon when ``scaled``.
        Each part is its own matrix for the recipe (MuonEq's row norms, Muon+'s target)."""
        return split_newton_schulz_op(x, sizes, num_groups, self.table, self.num_ns_steps, self.repeat_last, self.ns_eps,
                                      None, self.precision, self.scale_mode if scaled else None,
                                      self.extra_scale_factor if scaled else 1.0, self.algorithm,
                                      self.recipe.op_arguments, self.products)

    def scale(self, rows: int, cols: int) -> float:
        """Muon's update scale of a (rows, cols) matrix, times ``extra_scale_factor``."""
        return get_muon_scale_factor(rows, cols, self.scale_mode) * self.extra_scale_factor


def check_matmul_precision(fp32_matmul_prec: str) -> None:
    """ValueError naming ``fp32_matmul_prec`` unless it is 'medium', 'high' or 'highest'."""
    try:
        validate_precision(fp32_matmul_prec)
    except ValueError:
        raise ValueError(
            f"fp32_matmul_prec must be one of 'medium', 'high', 'highest', got {fp32_matmul_prec!r}"
        ) from None


def make_config(
    *,
    nesterov: bool,
    weight_decay_method: str,
    fp32_matmul_prec: str,
    coefficient_type: str,
    custom_coefficient_sets: Sequence[Sequence[float]] | None,
    num_ns_steps: int,
    scale_mode: str,
    extra_scale_factor: float,
    moment2_method: str | None = None,
    ns_algorithm: str = "auto",
    ns_eps_mode: str = "clamp",
    ns_norm_divisor: float = 1.0,
    row_equilibration: bool = False,
    frobenius_renorm: bool = False,
    polar_express_safety: float | None = None,
    ns_eps: float = NS_EPS,
    use_syrk: bool = False,
    ns_products: str = "auto",
) -> OrthogonalizationConfig:
    """Validates the optimizer-wide arguments (ValueError naming the argument) and freezes them.
    ``use_syrk`` (Emerging-Optimizers' and Megatron-LM's switch for a SYRK kernel): True runs the
    Newton–Schulz ops with symmetric products; ``ns_products`` chooses them ("auto": by measurement,
    "symmetric", "full": one GEMM each)."""
    if weight_decay_method not in WEIGHT_DECAY_METHODS:
        raise ValueError(
            f"weight_decay_method must be one of {list(WEIGHT_DECAY_METHODS)}, got {weight_decay_method!r}"
        )
    check_matmul_precision(fp32_matmul_prec)
    if isinstance(num_ns_steps, bool) or not isinstance(num_ns_steps, int) or num_ns_steps < 1:
        raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
    table, _ = coefficient_table(coefficient_type, custom_coefficient_sets)  # ValueError on unknown / empty custom
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {list(SCALE_MODES)}, got {scale_mode!r}")
    if not isinstance(extra_scale_factor, Real) or not math.isfinite(extra_scale_factor):
        raise ValueError(f"extra_scale_factor must be a finite number, got {extra_scale_factor!r}")
    if ns_algorithm not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm must be one of {list(NS_ALGORITHMS)}, got {ns_algorithm!r}")
    if isinstance(ns_eps, bool) or not isinstance(ns_eps, Real) or not 0 < ns_eps < math.inf:
        raise ValueError(f"ns_eps must be a finite positive number, got {ns_eps!r}")
    if moment2_method is not None:
        if moment2_method not in MOMENT2_METHODS:
            raise ValueError(f"moment2_method must be one of {list(MOMENT2_METHODS)}, got {moment2_method!r}")
        if moment2_method == "namo" and weight_decay_method == "l2":
            raise ValueError('moment2_method="namo" is incompatible with weight_decay_method="l2"')
    recipe = NSRecipe.make(ns_eps_mode, ns_norm_divisor, row_equilibration, frobenius_renorm, ns_eps)
    custom = table if coefficient_type == "custom" else None
    _, repeat_last = coefficient_table(coefficient_type, custom)
    if polar_express_safety is not None:
        if coefficient_type != "polar_express":
            raise ValueError(f"polar_express_safety applies to coefficient_type='polar_express', got {coefficient_type!r}")
        table = polar_express_rows(polar_express_safety)  # past its end the last row repeats, as polar_express
    return OrthogonalizationConfig(
        recipe=recipe,
        coefficients=tuple(
            tuple(table[min(i, len(table) - 1)] if repeat_last else table[i % len(table)]) for i in range(num_ns_steps)
        ),
        table=tuple(float(v) for row in table for v in row),
        repeat_last=repeat_last,
        nesterov=bool(nesterov),
        weight_decay_method=weight_decay_method,
        precision=fp32_matmul_prec,
        coefficient_type=coefficient_type,
        custom_coefficient_sets=custom,
        num_ns_steps=num_ns_steps,
        scale_mode=scale_mode,
        extra_scale_factor=float(extra_scale_factor),
        moment2_method=moment2_method,
        algorithm=ns_algorithm,
        ns_eps=float(ns_eps),
        products=resolve_products(ns_products, use_syrk, "ns_products"),
    )


# Emerging-Optimizers 0.4 takes these arguments as given and raises when step() first uses one:
# an unknown moment2_method is a TypeError, an unknown weight-decay method, coefficient type or
# scale mode a ValueError. The fused classes keep that timing (docs/design.md §8.3) with their own messages.
STEP_TIME_ARGUMENTS = ("moment2_method", "weight_decay_method", "coefficient_type", "scale_mode")


def coefficient_type_error(coefficient_type: str, custom_coefficient_sets=None,
                           num_ns_steps: int | None = None) -> tuple[str, type, str] | None:
    """The error ``step()`` raises for an unusable Newton–Schulz coefficient type (EO 0.4 checks it
    when a step first uses it), or None. With ``num_ns_steps``, a fixed-length schedule (cubic5)
    run for another number of steps is such an error too."""
    try:
        coefficient_table(coefficient_type, custom_coefficient_sets)
        if isinstance(num_ns_steps, int) and not isinstance(num_ns_steps, bool) and num_ns_steps >= 0:
            check_steps(coefficient_type, num_ns_steps)
    except ValueError as e:
        return ("coefficient_type", ValueError, str(e))
    return None


def defer_step_time_errors(arguments: dict) -> tuple[dict, tuple[str, type, str] | None]:
    """Splits ``make_config``'s keyword arguments into ones it accepts and the error ``step()`` raises.

    Returns the arguments with each unusable value of :data:`STEP_TIME_ARGUMENTS` replaced by a
    valid stand-in (no step gets to use it: step() raises first) and ``(argument, exception type,
    message)`` of the first such argument in the order EO's step meets them (moment2_method,
    weight decay, Newton–Schulz coefficients, scale), or None when every one is valid.
    """
    arguments = dict(arguments)
    errors: list[tuple[str, type, str]] = []
    method = arguments.get("moment2_method")
    if method is not None and method not in MOMENT2_METHODS:
        errors.append(("moment2_method", TypeError,
                       f"moment2_method must be one of {list(MOMENT2_METHODS)}, got {method!r}"))
        arguments["moment2_method"] = "adamuon"
    if arguments["weight_decay_method"] not in WEIGHT_DECAY_METHODS:
        errors.append(("weight_decay_method", ValueError, f"weight_decay_method must be one of "
                       f"{list(WEIGHT_DECAY_METHODS)}, got {arguments['weight_decay_method']!r}"))
        arguments["weight_decay_method"] = "decoupled"
    coefficient_error = coefficient_type_error(arguments["coefficient_type"], arguments.get("custom_coefficient_sets"),
                                               arguments.get("num_ns_steps"))
    if coefficient_error is not None:
        errors.append(coefficient_error)
        arguments["coefficient_type"] = "polar_express" if arguments.get("polar_express_safety") else "quintic"
        arguments["custom_coefficient_sets"] = None
    if arguments["scale_mode"] not in SCALE_MODES:
        errors.append(("scale_mode", ValueError,
                       f"scale_mode must be one of {list(SCALE_MODES)}, got {arguments['scale_mode']!r}"))
        arguments["scale_mode"] = "spectral"
    return arguments, (errors[0] if errors else None)


# make_config's keyword arguments: a constructor hands them on by name (fused_config).
CONFIG_ARGUMENTS = tuple(inspect.signature(make_config).parameters)


def fused_config(arguments: dict, *, defer: bool = True,
                 **overrides) -> tuple[OrthogonalizationConfig, tuple[str, type, str] | None]:
    """The one way a fused optimizer makes its configuration: from its constructor's arguments
    (``locals()``; the names ``make_config`` takes are picked, ``overrides`` replace or add), with
    Emerging-Optimizers' step-time errors deferred (``defer``; else every bad value raises here).
    Returns the configuration and the deferred error (None: none)."""
    picked = {k: arguments[k] for k in CONFIG_ARGUMENTS if k in arguments}
    picked.update(overrides)
    deferred = None
    if defer:
        picked, deferred = defer_step_time_errors(picked)
    return make_config(**picked), deferred


class ConfigSetting:
    """An Emerging-Optimizers attribute (``opt.nesterov``, ``opt.fp32_matmul_prec``...) whose one home
    is a field of the optimizer's fused configuration; an instance value only for an EO-style
    optimizer, which has none. Setting it on a fused optimizer re-makes the configuration (EO reads
    these attributes at every step, so a value set after construction applies to the next step);
    ``settable=False`` fields decide the state's layout and are fixed at construction.

    ``check`` validates a new value of a fused optimizer; ``always_checked`` applies it to an EO-style
    optimizer too (a setting EO itself takes as given, e.g. ``weight_decay_method``, fails at its
    step instead). ``convert`` normalizes the value stored (``bool`` for ``nesterov``)."""

    def __init__(self, field: str, check=None, settable: bool = True, always_checked: bool = False,
                 convert=None) -> None:
        self.field, self.check, self.settable = field, check, settable
        self.always_checked, self.convert = always_checked, convert

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        config = obj.__dict__.get("_config")
        if config is not None:
            return getattr(config, self.field)
        try:
            return obj.__dict__[self.slot]
        except KeyError:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r}") from None

    def __set__(self, obj, value) -> None:
        config = obj.__dict__.get("_config")
        if config is None:
            if self.always_checked:
                self.check(value)
            obj.__dict__[self.slot] = value
            return
        if self.convert is not None:
            value = self.convert(value)
        if getattr(config, self.field) == value:
            return
        if not self.settable:
            raise AttributeError(f"{self.name} is fixed at construction (it decides the optimizer's state)")
        if self.check is not None:
            self.check(value)
        obj._use_config(dataclasses.replace(config, **{self.field: value}))


class ReadOnlySetting:
    """An Emerging-Optimizers ``Muon`` property that reads the fused configuration and cannot be set
    (EO main's ``num_ns_steps``, ``coefficient_type``, ``use_syrk``): assigning raises
    ``AttributeError("Cannot set `<name>` post-initialization.")``, as EO does, even the same value.
    ``read`` maps the configuration to the value (default: its field ``field``)."""

    def __init__(self, field: str | None = None, read=None) -> None:
        self.field, self.read = field, read

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        config = obj.__dict__.get("_config")
        if config is None:
            raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r} before its configuration")
        return self.read(config) if self.read is not None else getattr(config, self.field)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"Cannot set `{self.name}` post-initialization.")


def config_setting_names(cls) -> list[str]:
    """The attributes of ``cls`` that are ConfigSettings."""
    return [name for name in dir(cls) if isinstance(getattr(cls, name, None), ConfigSetting)]


def check_weight_decay_method(value) -> None:
    if value not in WEIGHT_DECAY_METHODS:
        raise ValueError(f"weight_decay_method must be one of {list(WEIGHT_DECAY_METHODS)}, got {value!r}")


def check_scale_mode(value) -> None:
    if value not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {list(SCALE_MODES)}, got {value!r}")


def check_extra_scale_factor(value) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"extra_scale_factor must be a finite number, got {value!r}")


def _number(name: str, value) -> float | None:
    """The value of a hyper-parameter for a range check; None for a tensor living on an accelerator."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} given as a tensor must have one element, got shape {tuple(value.shape)}")
        if value.device.type != "cpu":
            return None  # reading it would synchronize; the scheduler owns it
        return float(value)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number or a one-element tensor, got {type(value).__name__}")
    return float(value)


def check_group_hyperparameters(group: dict, where: str, momentum_below_one: bool = True) -> None:
    """Range checks of the per-group values (lr, momentum, weight_decay, beta2, eps). Momentum is
    in [0, 1), or any value >= 0 with ``momentum_below_one=False`` (torch.optim.Muon's range)."""
    checks = {
        "lr": lambda v: v >= 0,
        "weight_decay": lambda v: v >= 0,
        "momentum": (lambda v: 0 <= v < 1) if momentum_below_one else (lambda v: v >= 0),
        "beta2": lambda v: 0 <= v < 1,
        "eps": lambda v: v > 0,
    }
    rules = {"lr": ">= 0", "weight_decay": ">= 0", "momentum": "in [0, 1)" if momentum_below_one else ">= 0",
             "beta2": "in [0, 1)", "eps": "> 0"}
    for key, ok in checks.items():
        if key not in group:
            continue
        v = _number(f"{where}['{key}']", group[key])
        if v is not None and not (math.isfinite(v) and ok(v)):
            raise ValueError(f"{where}['{key}'] must be finite and {rules[key]}, got {group[key]!r}")


# Per-step values of a param group and what each must be (scheduler-written, checked every step).
# Written as chained comparisons, which are False for NaN and stay traceable under torch.compile.
_FLT_MAX = 3.4028234663852886e38
_FLT_TRUE_MIN = 2.0**-149
_STEP_RULES = {
    "lr": (lambda v: 0.0 <= v < math.inf, "finite and >= 0"),
    "weight_decay": (lambda v: 0.0 <= v < math.inf, "finite and >= 0"),
    "momentum": (lambda v: 0.0 <= v < 1.0, "finite and in [0, 1)"),
    "momentum_unbounded": (lambda v: 0.0 <= v < math.inf, "finite and >= 0"),
    "beta2": (lambda v: 0.0 <= v <= 1.0, "finite and in [0, 1]"),
    "eps": (lambda v: _FLT_TRUE_MIN <= v <= _FLT_MAX, "finite and positive in float32"),
}


def check_step_value(key: str, value, where: str, momentum_below_one: bool = True) -> None:
    """Raises ValueError when a per-step value read from a param group is out of range.

    Python numbers (and CPU tensors, outside torch.compile) are checked; a device tensor's value is
    not read, since that would synchronize with the device.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or torch.compiler.is_compiling():
            return
        value = float(value)
    ok, rule = _STEP_RULES["momentum_unbounded" if key == "momentum" and not momentum_below_one else key]
    if not ok(value):
        raise ValueError(f"{where}['{key}'] must be {rule}, got {value!r}")
