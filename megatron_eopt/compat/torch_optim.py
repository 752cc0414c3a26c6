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

Three opt-in param-group keys go beyond torch (see the class docstring): ``nd_mode`` (N-D weights
as flattened matrices or batches of matrices), ``algorithm`` (standard or Gram Newton–Schulz) and
``split_heads`` (a fused attention weight orthogonalized per head, through the split Newton–Schulz
op of fused QKV projections). Groups without them step, save and fail exactly as torch's.
"""

from __future__ import annotations

import inspect
import math
from numbers import Real
from typing import Any, Callable

import torch
from torch.optim.optimizer import ParamsT

from ..optim._closure import closure_loss
from ..low_memory_state import DEFAULT_BLOCK_SIZE
from ..optim._config import OrthogonalizationConfig, check_matmul_precision, make_config
from ..optim.matrix_view import check_nd_mode, not_a_matrix
from ..optim.step.grouping import DEFAULT_WORKSPACE_MIB, Plan
from ..optim.orthogonalized import OrthogonalizedOptimizer, _plan_matches
from ..coefficients import NS_ALGORITHMS

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

# The opt-in param-group keys and what a group without one does (torch's behaviour). A key given to
# the constructor becomes a default of every group (and so is saved with each group); a group that
# lacks it (e.g. loaded from torch's checkpoint) falls back to the constructor's value, else to these.
EXTENSION_DEFAULTS: dict[str, Any] = {"nd_mode": "error", "algorithm": "auto", "split_heads": None}


def _check_extension_argument(key: str, value: Any) -> None:
    """ValueError naming the constructor keyword ``key`` unless ``value`` is usable (None: not given)."""
    if value is None:
        return
    problem = _extension_value_problem(key, value)
    if problem is not None:
        raise ValueError(f"{key} {problem}")


def _extension_value_problem(key: str, value: Any) -> str | None:
    """What is wrong with one value of an extension key (None: nothing), to follow the key's name."""
    if key == "nd_mode":
        try:
            check_nd_mode(value, "")
        except ValueError as exc:
            return str(exc).strip()
    elif key == "algorithm":
        if not isinstance(value, str) or value not in NS_ALGORITHMS:
            return f"must be one of {list(NS_ALGORITHMS)}, got {value!r}"
    elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return f"must be None or the number of heads (an int >= 1), got {value!r}"
    return None


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

    Opt-in param-group keys beyond torch (each also a constructor keyword, then the default of every
    group; a group or constructor without them is torch's Muon, its checkpoints included):

    - ``nd_mode``: params of more than two dims. ``"error"`` (default) refuses them as torch does;
      ``"flatten"`` steps ``p.view(p.shape[0], -1)`` (trailing dims flattened into the columns:
      convolutions ``(out, in, kh, kw)`` as ``(out, in*kh*kw)``); ``"batch"`` steps a batch of
      matrices ``p.view(-1, m, n)`` over the leading dims (per-expert MoE weights ``(E, m, n)``,
      per-head blocks ``(H, head_dim, d)``), each orthogonalized and scaled as its own ``(m, n)``
      matrix. A 2-D param is the same under every mode. The param's dims must be contiguous for
      the view.
    - ``algorithm``: the Newton–Schulz iteration, ``"auto"`` (default, as before), ``"standard"``
      (on X) or ``"gram"`` (on the Gram matrix of the short side: fewer FLOPs for rectangular
      matrices, the same result within the precision's tolerance).
    - ``split_heads``: an int ``H`` (default None, no split). Every param of the group is a fused
      attention weight whose rows are ``H`` equal blocks of ``rows // H`` (``(H*head_dim, d)``, or its
      ``nd_mode="flatten"`` view): each block is orthogonalized on its own and its update scaled by
      ``adjust_lr_fn`` of the block's shape ``(rows // H, cols)``, exactly as torch's Muon stepping each
      block as a 2-D parameter (momentum, lr and weight decay are elementwise, so they are the
      same either way). Put fused attention weights in a group of their own.

    Each key is saved with the groups that carry it (``state_dict``) and read at every step, as
    torch's keys are. A bad value (an unknown ``nd_mode`` or ``algorithm``, ``split_heads`` that is
    not a positive int or does not divide a param's rows, ``split_heads`` with a 3-D
    ``nd_mode="batch"`` view, a param whose dims cannot be viewed as matrices) raises ValueError
    naming the key at construction or ``add_param_group``, before anything changes; written into a
    group later, at ``step()``, before anything changes.

    Errors are torch's, raised where torch raises them: bad ``lr`` / ``momentum`` /
    ``weight_decay`` / ``adjust_lr_fn`` and non-2-D params at construction (ValueError); complex
    params and sparse gradients (RuntimeError), a non-2-D param added later, ``ns_steps >= 100``
    and ``ns_coefficients`` not of length 3 (ValueError) at ``step()`` (N-D params and gradients
    are matrices where a group's ``nd_mode`` is ``"flatten"`` or ``"batch"``). Unlike torch, a step that
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
        nd_mode: str | None = None,
        algorithm: str | None = None,
        split_heads: int | None = None,
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
        extensions = dict(nd_mode=nd_mode, algorithm=algorithm, split_heads=split_heads)
        for key, value in extensions.items():
            _check_extension_argument(key, value)
        check_matmul_precision(fp32_matmul_prec)
        self.fp32_matmul_prec = fp32_matmul_prec
        self._configs: dict[tuple, tuple[OrthogonalizationConfig, str | None]] = {}
        defaults: dict[str, Any] = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )
        if _HAS_FOREACH:
            defaults["foreach"] = foreach
        # Given keys join torch's defaults (so every group carries them); absent ones stay absent.
        defaults.update({k: v for k, v in extensions.items() if v is not None})
        self._head_sizes: dict[int, tuple[int, ...]] = {}
        self._layout_key: tuple = ()
        base, _ = self._settings(defaults)
        self._init_fused(params, defaults, base, nd_mode=defaults.get("nd_mode", "error"), state_dtype=state_dtype,
                         state_block_size=state_block_size, workspace_mib=workspace_mib)
        for group in self.param_groups:
            nd_mode = self._option(group, "nd_mode")
            for p in group["params"]:
                if not_a_matrix(p, nd_mode):
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
        algorithm = self._option(group, "algorithm")
        if not isinstance(algorithm, str):
            algorithm = ("invalid", repr(algorithm))
        key = (bool(group["nesterov"]), coefficient_key, group["eps"], group["ns_steps"], group["adjust_lr_fn"])
        key = (*key, algorithm, self.fp32_matmul_prec)
        hit = self._configs.get(key)
        if hit is None:
            hit = self._configs[key] = _make_settings(*key)
        return hit

    def _group_config(self, group: dict) -> OrthogonalizationConfig:
        return self._settings(group)[0]

    def _option(self, group: dict, key: str) -> Any:
        """A group's value of an extension key: its own, else the constructor's, else torch's behaviour."""
        if key in group:
            return group[key]
        return getattr(self, "defaults", {}).get(key, EXTENSION_DEFAULTS[key])

    def _layout(self) -> tuple:
        """(nd_mode, split_heads) of every group: what the plan's matrix views were built from."""
        return tuple((self._option(g, "nd_mode"), self._option(g, "split_heads")) for g in self.param_groups)

    def _plan_is_current(self, plan: Plan) -> bool:
        # torch reads nesterov, ns_coefficients, eps, ns_steps and adjust_lr_fn from each group at
        # every step (and this class algorithm, nd_mode and split_heads): a changed setting
        # regroups the stacks once.
        return (
            _plan_matches(plan, self.param_groups)
            and all(a is b for a, b in zip(plan.configs, self._group_configs()))
            and self._layout_key == self._layout()
        )

    def _rebuild_plan(self, agree_ranks: bool = True) -> None:
        # split_heads: the fused weight's rows as H equal parts, each its own matrix (the split
        # Newton–Schulz of fused QKV projections, one query group). Unusable values split nothing
        # here: add_param_group and step() refuse them.
        heads: dict[int, tuple[int, ...]] = {}
        for group in self.param_groups:
            nd_mode, h = self._option(group, "nd_mode"), self._option(group, "split_heads")
            if h is None or _extension_value_problem("split_heads", h) is not None or h == 1:
                continue
            for p in group["params"]:
                if (p.ndim == 2 or (p.ndim > 2 and nd_mode == "flatten")) and p.shape[0] % h == 0:
                    heads[id(p)] = (p.shape[0] // h,) * h
        self._head_sizes = heads
        self._layout_key = self._layout()
        super()._rebuild_plan(agree_ranks)

    def _split_shapes_of(self, p: torch.Tensor) -> list[int] | None:
        sizes = self._head_sizes.get(id(p))
        return None if sizes is None else list(sizes)

    def _check_param(self, p: torch.Tensor, nd_mode: str, where: str) -> None:
        # torch accepts any tensor at add_param_group: 2-D is checked for the constructor's params
        # (above), complex params and other shapes are refused at step. An N-D param a group's
        # nd_mode makes a matrix must have the matrix view (refused here, naming nd_mode).
        if p.ndim > 2 and not not_a_matrix(p, nd_mode) and p.is_floating_point():
            super()._check_param(p, nd_mode, where)

    @torch._disable_dynamo
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # torch's defaults filled in, nd_mode and the views checked
        gi = len(self.param_groups) - 1
        problem = self._extension_problem(self.param_groups[gi], gi)
        if problem is not None:
            self.param_groups.pop()
            if self._constructed:
                self._rebuild_plan()
            raise ValueError(problem)

    def _extension_problem(self, group: dict, gi: int) -> str | None:
        """What is wrong with a group's nd_mode, algorithm or split_heads (None: nothing)."""
        if not any(key in group or key in getattr(self, "defaults", {}) for key in EXTENSION_DEFAULTS):
            return None  # torch's group
        for key in EXTENSION_DEFAULTS:
            value = self._option(group, key)
            if key == "split_heads" and value is None:
                continue
            problem = _extension_value_problem(key, value)
            if problem is not None:
                return f"param_groups[{gi}]['{key}'] {problem}"
        h = self._option(group, "split_heads")
        if h is None:
            return None
        nd_mode = self._option(group, "nd_mode")
        for pi, p in enumerate(group["params"]):
            if not_a_matrix(p, nd_mode):
                continue  # not a matrix: torch's own error, at step
            where = f"param_groups[{gi}]['params'][{pi}]"
            if p.ndim > 2 and nd_mode == "batch":
                return (
                    f"param_groups[{gi}]['split_heads'] splits the rows of one matrix; {where} of shape "
                    f"{tuple(p.shape)} is a batch of matrices with nd_mode='batch' (split a 2-D fused weight, or "
                    "use nd_mode='flatten')"
                )
            if p.shape[0] % h != 0:
                return (
                    f"param_groups[{gi}]['split_heads'] = {h} does not divide the {p.shape[0]} rows of {where} "
                    f"(shape {tuple(p.shape)}): a fused weight has num_heads * head_dim rows"
                )
        return None

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
            extension = self._extension_problem(group, gi)
            if extension is not None:
                return ValueError(extension)
            problem = self._settings(group)[1]
            nd_mode = self._option(group, "nd_mode")
            for p in with_grad:
                if not_a_matrix(p.grad, nd_mode):
                    return ValueError("Param gradient must be a 2D matrix")
                if problem is not None:
                    return ValueError(problem.format(gi=gi))
        return None

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step; ``closure`` (re-evaluates the model and returns the loss) runs first, with
        gradients enabled, and its loss is returned, as in torch."""
        loss = closure_loss(closure)
        self._run_step()
        return loss


def _make_settings(nesterov: bool, coefficients, eps, ns_steps, adjust_lr_fn, algorithm,
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
    if algorithm not in NS_ALGORITHMS:  # refused earlier by add_param_group / step (the key named)
        algorithm = EXTENSION_DEFAULTS["algorithm"]
    if problem is not None:
        coefficients, eps, ns_steps, adjust_lr_fn = DEFAULT_NS_COEFFICIENTS, DEFAULT_EPS, DEFAULT_NS_STEPS, None
    scale_mode, extra = _SCALES[adjust_lr_fn]
    config = make_config(
        nesterov=nesterov, weight_decay_method="decoupled", fp32_matmul_prec=precision,
        coefficient_type="custom", custom_coefficient_sets=[tuple(coefficients)], num_ns_steps=ns_steps,
        scale_mode=scale_mode, extra_scale_factor=extra, ns_eps_mode="clamp", ns_eps=float(eps),
        ns_algorithm=algorithm,
    )
    return config, problem
