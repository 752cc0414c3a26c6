"""``torch.optim.Muon`` (PyTorch >= 2.9) on the fused ops, served by ``megatron_eopt.torch_optim``.

Code written against torch's Muon changes one import::

    from megatron_eopt.torch_optim import Muon   # was: from torch.optim import Muon

and keeps its constructor, defaults, param-group keys, state layout, ``step(closure)``, errors and
checkpoints. What torch does per parameter, in a Python loop, runs here as one fused momentum
launch per param group, one batched Newton–Schulz per matrix shape and one fused update.

torch's step, per 2-D parameter ``p`` with gradient ``g``, settings read from its param group::

    buf.lerp_(g, 1 - momentum)
    u = g.lerp(buf, momentum) if nesterov else buf
    u = NS(u; ns_coefficients, ns_steps, eps)    # X / max(||X||_F, eps), then (a, b, c) ns_steps times
    p *= 1 - lr * weight_decay
    p -= lr * ratio(adjust_lr_fn, shape) * u     # original sqrt(max(1, m/n)), match_rms_adamw
                                                 # 0.2 sqrt(max(m, n)), spectral_unclamped sqrt(m/n)

In the fused optimizer's terms each param group is a Muon configuration of its own: decoupled
decay, ``coefficient_type="custom"`` with the one row ``ns_coefficients`` (cycled), ``ns_eps=eps``
with the clamp normalization, and the scale modes ``shape_scaling``, ``spectral`` x 0.2 and
``unit_rms_norm``. Groups with different settings are batched apart; a setting changed in a group
between steps (or restored by ``load_state_dict``) takes effect at the next step, as in torch.
"""

from __future__ import annotations

import inspect
import math
from numbers import Real
from typing import Any, Callable

import torch
from torch.optim.optimizer import ParamsT

from ..low_memory_state import DEFAULT_BLOCK_SIZE
from ..optim._plan import DEFAULT_WORKSPACE_MIB
from ..optim._config import OrthogonalizationConfig, check_matmul_precision, make_config
from ..optim._plan import Plan
from ..optim.orthogonalized import OrthogonalizedOptimizer, _plan_matches

# torch.optim.Muon's defaults (Keller Jordan's constants).
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")
MAX_NS_STEPS = 100  # torch refuses ns_steps >= 100 at step

# adjust_lr_fn -> (scale_mode, extra_scale_factor) of the fused optimizer.
_SCALES = {
    None: ("shape_scaling", 1.0),
    "original": ("shape_scaling", 1.0),
    "match_rms_adamw": ("spectral", 0.2),
    "spectral_unclamped": ("unit_rms_norm", 1.0),
}


def _torch_muon_takes_foreach() -> bool:
    """True when the installed torch's Muon has a ``foreach`` argument (then its groups carry it)."""
    cls = getattr(torch.optim, "Muon", None)
    return cls is not None and "foreach" in inspect.signature(cls.__init__).parameters


_HAS_FOREACH = _torch_muon_takes_foreach()


class Muon(OrthogonalizedOptimizer):
    """torch.optim.Muon's interface on the fused Muon step (see the module docstring).

    Arguments, defaults, param-group and ``defaults`` keys are torch's: ``lr=1e-3,
    weight_decay=0.1, momentum=0.95, nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315),
    eps=1e-7, ns_steps=5, adjust_lr_fn=None`` (and ``foreach`` where the installed torch's Muon has
    it; the fused step is used either way). State: ``momentum_buffer``, shaped like the param.

    Extensions, keyword-only and kept off the param groups (a checkpoint stays torch's):

    - ``fp32_matmul_prec``: the Newton–Schulz products. ``"medium"`` (default) multiplies bf16
      operands with fp32 accumulation, as torch's bf16 iteration does; ``"high"`` TF32 on CUDA;
      ``"highest"`` fp32 throughout (closer to exact than torch's own bf16 result);
    - ``workspace_mib``: the step's workspace budget (see :class:`megatron_eopt.optim.Muon`);
    - ``state_dtype`` / ``state_block_size``: low-memory momentum (see
      :mod:`megatron_eopt.low_memory_state`).

    Errors are torch's, raised where torch raises them: bad ``lr`` / ``momentum`` /
    ``weight_decay`` / ``adjust_lr_fn`` and non-2-D params at construction (ValueError); complex
    params and sparse gradients (RuntimeError), a non-2-D param added later, ``ns_steps >= 100``
    and ``ns_coefficients`` not of length 3 (ValueError) at ``step()``. Unlike torch, a step that
    raises has changed nothing. Two settings torch would run and this class refuses at ``step()``
    (ValueError naming the group key): ``eps <= 0`` and an ``adjust_lr_fn`` written into a group
    after construction that is none of torch's names (torch then skips the adjustment).
    """

    _momentum_below_one = False  # torch accepts any momentum >= 0

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        foreach: bool | None = None,
        fp32_matmul_prec: str = "medium",
        state_dtype: str = "fp32",
        state_block_size: int = DEFAULT_BLOCK_SIZE,
        workspace_mib: float | str | None = DEFAULT_WORKSPACE_MIB,
    ) -> None:
        # torch's checks, in torch's order and words.
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        check_matmul_precision(fp32_matmul_prec)
        self.fp32_matmul_prec = fp32_matmul_prec
        self._configs: dict[tuple, tuple[OrthogonalizationConfig, str | None]] = {}
        defaults: dict[str, Any] = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )
        if _HAS_FOREACH:
            defaults["foreach"] = foreach
        base, _ = self._settings(defaults)
        self._init_fused(params, defaults, base, state_dtype=state_dtype, state_block_size=state_block_size,
                         workspace_mib=workspace_mib)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only supports 2D parameters whereas we found a parameter with size: {p.size()}"
                    )

    # torch.optim.Optimizer runs add_param_group, state_dict, load_state_dict and zero_grad outside
    # dynamo; construction goes with them, so an optimizer built inside a compiled function is
    # built eagerly, as torch's is.
    __init__ = torch._disable_dynamo(__init__)

    # ------------------------------------------------------------------ per-group settings
    def _settings(self, group: dict) -> tuple[OrthogonalizationConfig, str | None]:
        """The fused configuration of a group's torch settings and, when torch would refuse them at
        step (or this class cannot run them), the message ``step()`` raises."""
        coefficients = group["ns_coefficients"]
        try:
            coefficient_key = tuple(float(c) for c in coefficients)
        except (TypeError, ValueError):
            coefficient_key = ("invalid", repr(coefficients))
        key = (bool(group["nesterov"]), coefficient_key, group["eps"], group["ns_steps"], group["adjust_lr_fn"])
        key = (*key, self.fp32_matmul_prec)
        hit = self._configs.get(key)
        if hit is None:
            hit = self._configs[key] = _make_settings(*key)
        return hit

    def _group_config(self, group: dict) -> OrthogonalizationConfig:
        return self._settings(group)[0]

    def _plan_is_current(self, plan: Plan) -> bool:
        # torch reads nesterov, ns_coefficients, eps, ns_steps and adjust_lr_fn from each group at
        # every step: a changed setting regroups the stacks once.
        return _plan_matches(plan, self.param_groups) and all(
            a is b for a, b in zip(plan.configs, self._group_configs())
        )

    def _check_param(self, p: torch.Tensor, nd_mode: str, where: str) -> None:
        # torch accepts any tensor at add_param_group: 2-D is checked for the constructor's params
        # (above), complex params and other shapes are refused at step.
        return

    # ------------------------------------------------------------------ torch's step-time errors
    def _step_time_error(self, at_construction: bool = False) -> Exception | None:
        """What torch's step raises for these groups (None: none), met in torch's order: per group,
        complex params and sparse gradients, then per param the shape and the group's settings."""
        for gi, group in enumerate(self.param_groups):
            with_grad = [p for p in group["params"] if p.grad is not None]
            for p in with_grad:
                if torch.is_complex(p):
                    return RuntimeError("Muon does not support complex parameters")
                if p.grad.is_sparse:
                    return RuntimeError("Muon does not support sparse gradients")
            if not with_grad:
                continue
            problem = self._settings(group)[1]
            for p in with_grad:
                if p.grad.ndim != 2:
                    return ValueError("Param gradient must be a 2D matrix")
                if problem is not None:
                    return ValueError(problem.format(gi=gi))
        return None

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step; ``closure`` (re-evaluates the model and returns the loss) runs first, with
        gradients enabled, and its loss is returned, as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._run_step()
        return loss


def _make_settings(nesterov: bool, coefficients, eps, ns_steps, adjust_lr_fn,
                   precision: str) -> tuple[OrthogonalizationConfig, str | None]:
    """(fused configuration, step-time message or None) of one group's torch settings. An unusable
    setting gets torch's defaults as a stand-in configuration: no step runs with it (step raises)."""
    problem = None
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int):
        problem = f"param_groups[{{gi}}]['ns_steps'] must be an int, got {ns_steps!r}"
    elif ns_steps >= MAX_NS_STEPS:
        problem = "Number of steps must be less than 100 for computational efficiency"
    elif ns_steps < 1:
        problem = f"param_groups[{{gi}}]['ns_steps'] must be at least 1, got {ns_steps}"
    elif coefficients[0] == "invalid" or len(coefficients) != 3:
        problem = "Coefficients must be a tuple of exactly 3 values"
    elif isinstance(eps, bool) or not isinstance(eps, Real) or not 0 < eps < math.inf:
        problem = f"param_groups[{{gi}}]['eps'] must be a finite positive number, got {eps!r}"
    elif adjust_lr_fn not in _SCALES:
        problem = (f"param_groups[{{gi}}]['adjust_lr_fn'] must be None or one of {list(ADJUST_LR_FNS)}, "
                   f"got {adjust_lr_fn!r}")
    elif not all(math.isfinite(c) for c in coefficients):
        problem = f"param_groups[{{gi}}]['ns_coefficients'] must be finite, got {coefficients!r}"
    if problem is not None:
        coefficients, eps, ns_steps, adjust_lr_fn = DEFAULT_NS_COEFFICIENTS, DEFAULT_EPS, DEFAULT_NS_STEPS, None
    scale_mode, extra = _SCALES[adjust_lr_fn]
    config = make_config(
        nesterov=nesterov, weight_decay_method="decoupled", fp32_matmul_prec=precision,
        coefficient_type="custom", custom_coefficient_sets=[tuple(coefficients)], num_ns_steps=ns_steps,
        scale_mode=scale_mode, extra_scale_factor=extra, ns_eps_mode="clamp", ns_eps=float(eps),
    )
    return config, problem
