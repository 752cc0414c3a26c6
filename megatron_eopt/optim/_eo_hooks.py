"""Emerging-Optimizers' extension points and the per-parameter step that honours them.

EO subclasses customize a step by overriding methods (``_apply_weight_decay_inplace``,
``pre_weight_update_fn_inplace``, ``post_weight_update_fn_inplace``, ``_init_group``; AdaptiveMuon's
``_apply_moment2_normalization``, ``_apply_muon_scale``, ``_match_frobenius_norm``), by passing their
own ``scaled_orthogonalize_fn``, or by a ``weight_update_hook``. The fused step reproduces the
default of each; as soon as one is replaced, :meth:`EOExtensionPoints._hook_step` runs instead: EO's
loop, parameter by parameter, in EO's order, calling every extension point, with the Newton–Schulz
of the optimizer's own ``scaled_orthogonalize_fn`` still running on the fused op.
"""

from __future__ import annotations

from typing import Any

import torch

from .._precision import fp32_matmul_precision
from ._config import OrthogonalizationConfig

# The extension points whose defaults the fused step reproduces (AdaptiveMuon adds its own).
BASE_HOOK_NAMES = (
    "_apply_weight_decay_inplace",
    "pre_weight_update_fn_inplace",
    "post_weight_update_fn_inplace",
    "_init_group",
)
# Hooks whose batched form the fused step can run (elementwise or per-matrix norms).
# (ShardedHyperballHook: the hyperball with norms summed over tensor-parallel shards, optim.muon_ht.)
FUSABLE_WEIGHT_UPDATE_HOOKS = ("HyperballHook", "ShardedHyperballHook", "RadialBrakeHook", "RelativeUpdateHook",
                               "NoOpWeightUpdateHook")


class FusedScaledOrthogonalize:
    """An optimizer's own ``scaled_orthogonalize_fn``: Newton–Schulz on the fused op with the
    optimizer's configuration, times the Muon scale of the matrix (``scaled``) or raw (AdaptiveMuon,
    which scales after its second moment). Takes a 2-D ``(m, n)`` or 3-D ``(k, m, n)`` tensor."""

    supports_batch = True  # a (k, m, n) stack gives the k results of its matrices

    def __init__(self, config: OrthogonalizationConfig, scaled: bool) -> None:
        self.config = config
        self.scaled = scaled

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if grad.ndim not in (2, 3):
            raise ValueError(f"Only 2D parameters are supported, got shape {tuple(grad.shape)}")
        x = grad.to(torch.float32)
        out = self.config.newton_schulz(x if x.ndim == 3 else x.unsqueeze(0))
        out = out if x.ndim == 3 else out[0]
        return out * self.config.scale(*grad.shape[-2:]) if self.scaled else out


class EOExtensionPoints:
    """Emerging-Optimizers' overridable methods, their default behaviour, and the step that calls them."""

    # name -> the function whose behaviour the fused step reproduces (set below and by AdaptiveMuon)
    _fused_hook_defaults: dict[str, Any] = {}

    # ------------------------------------------------------------------ EO's defaults
    def _apply_weight_decay_inplace(self, p: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float) -> None:
        """Weight decay by ``weight_decay_method``: p or grad changed in place (EO's WeightDecayMixin)."""
        if weight_decay == 0.0:
            return
        method = getattr(self, "weight_decay_method", "l2")
        if method == "decoupled":
            p.add_(p, alpha=(-weight_decay * lr))
        elif method == "independent":
            p.add_(p, alpha=-weight_decay)
        elif method == "l2":
            grad.add_(p, alpha=weight_decay)
        elif method == "palm":
            p.add_(p, alpha=(-(weight_decay * lr * lr)))
        else:
            raise ValueError(f"Invalid weight decay method: {method}")

    def pre_weight_update_fn_inplace(self, p: torch.Tensor, update: torch.Tensor) -> None:
        """Called before ``p -= lr * update``; may change ``update`` in place. Default: nothing."""

    def post_weight_update_fn_inplace(self, p: torch.Tensor) -> None:
        """Called after ``p -= lr * update``. Default: nothing."""

    def _init_group(self, group: dict, skip_non_grad_params: bool = True) -> None:
        """Creates the state of the group's parameters (with a grad, unless told otherwise)."""
        for p in group["params"]:
            if skip_non_grad_params and p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                state["momentum_buffer"] = torch.zeros_like(p)

    # ------------------------------------------------------------------ errors at step(), as EO raises them
    def _step_time_error(self, at_construction: bool = False) -> Exception | None:
        """The error ``step()`` raises before touching anything (None: none), in EO 0.4's terms: an
        argument it checks when a step first uses it (once any param has a gradient), then the first
        param that is not a matrix (with a gradient, or any for AdaptiveMuon). ``at_construction``:
        the same, gradients or not (for wrappers that validate their inner optimizer up front)."""
        if self._config is None:
            return self._eo_style_step_error()
        plan = self._current_plan()
        if self._deferred_error is None and not plan.rejected:
            return None
        has_grad = at_construction or any(p.grad is not None for g in self.param_groups for p in g["params"])
        if self._deferred_error is not None and has_grad:
            _, exc_type, message = self._deferred_error
            return exc_type(message)
        for gi, pi in plan.rejected:
            group = self.param_groups[gi]
            p = group["params"][pi]
            if at_construction or self._nd_error_without_grad or p.grad is not None:
                return self._nd_error_type(self._not_a_matrix_message(p, f"param_groups[{gi}]['params'][{pi}]"))
        return None

    def _eo_style_step_error(self) -> Exception | None:
        """What an EO-style optimizer (caller's ``scaled_orthogonalize_fn``) would refuse midway through
        its loop, refused before anything changes: a deferred argument, an unknown weight-decay method
        (while ``_apply_weight_decay_inplace`` is EO's), a param that is not a matrix (while
        ``orthogonalize`` is the base one; an override may handle N-D params, as EO says)."""
        active = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                  if p.grad is not None]
        if not active:
            return None
        if self._deferred_error is not None:
            _, exc_type, message = self._deferred_error
            return exc_type(message)
        cls = type(self)
        method = getattr(self, "weight_decay_method", "l2")
        if (cls._apply_weight_decay_inplace is EOExtensionPoints._apply_weight_decay_inplace
                and method not in EO_WEIGHT_DECAY_METHODS
                and any(_nonzero(self.param_groups[gi]["weight_decay"]) for gi, _, _ in active)):
            return ValueError(f"Invalid weight decay method: {method} (expected one of "
                              f"{', '.join(EO_WEIGHT_DECAY_METHODS)})")
        if self._orthogonalize_is_base():
            for gi, pi, p in active:
                if p.ndim != 2:
                    return ValueError(
                        f"Only 2D parameters are supported: param_groups[{gi}]['params'][{pi}] has shape "
                        f"{tuple(p.shape)}"
                    )
        return None

    # ------------------------------------------------------------------ which step runs
    def overridden_extension_points(self) -> list[str]:
        """The extension points this object's class replaces (the fused step runs when none is)."""
        cls = type(self)
        return [name for name, default in self._fused_hook_defaults.items() if getattr(cls, name) is not default]

    def _fusable_weight_update_hook(self) -> bool:
        hook = getattr(self, "_weight_update_hook", None)
        return hook is None or type(hook).__name__ in FUSABLE_WEIGHT_UPDATE_HOOKS and hasattr(hook, "fused_pre")

    def _use_fused_step(self) -> bool:
        config = getattr(self, "_config", None)
        fn = getattr(self, "scaled_orthogonalize_fn", None)
        return (
            config is not None
            and isinstance(fn, FusedScaledOrthogonalize)
            and fn.config is config
            and not self.overridden_extension_points()
            and self._fusable_weight_update_hook()
        )

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # torch.amp.GradScaler hands the fused step grad_scale / found_inf; the hook step gets
        # unscaled gradients from the scaler, as EO's classes do.
        return self._use_fused_step()

    # ------------------------------------------------------------------ the per-parameter step
    def _hook_update(self, p, orth_grad, group, state, raw_grad, pre_orth_grad) -> torch.Tensor:
        """The update applied as ``p -= lr * update`` from the orthogonalized momentum (Muon: as is)."""
        return orth_grad

    def _post_weight_update_batch(self, params: list[torch.Tensor]) -> None:
        """``post_weight_update_fn_inplace`` of each parameter (a class may batch its own)."""
        for p in params:
            self.post_weight_update_fn_inplace(p)

    def _orthogonalize_is_base(self) -> bool:
        """True when ``orthogonalize`` is the base class's (which the per-parameter step may batch)."""
        return False

    def _orthogonalize_all(self, work: list[tuple], settings: list[dict]) -> list[torch.Tensor]:
        """``orthogonalize`` of every (p, momentum): one call per parameter, or, for an EO-style
        optimizer whose ``scaled_orthogonalize_fn`` takes stacks (``supports_batch``) and whose
        ``orthogonalize`` is the base one, one call per shape on the stacked momenta."""
        fn = self.scaled_orthogonalize_fn
        batchable = (
            getattr(self, "_config", None) is None
            and getattr(fn, "supports_batch", False)
            and self._orthogonalize_is_base()
        )
        if not batchable:
            return [self.orthogonalize(p, g, **kw) for (p, g), kw in zip(work, settings)]
        out: list[torch.Tensor | None] = [None] * len(work)
        stacks: dict[tuple, list[int]] = {}
        for i, (p, g) in enumerate(work):
            if g.ndim != 2:
                raise ValueError("Only 2D parameters are supported.")
            stacks.setdefault((tuple(g.shape), g.dtype, g.device), []).append(i)
        for index in stacks.values():
            results = fn(torch.stack([work[i][1] for i in index]))
            for i, r in zip(index, results.unbind(0)):
                out[i] = r
        return out

    @torch.no_grad()
    def _hook_step(self) -> None:
        """EO's step: every extension point in EO's order for each parameter.

        Parameters are independent, so decay and momentum run for all of them first, then the
        orthogonalization (batched per shape where the function allows), then, parameter by
        parameter as in EO, the update with its functions and hooks. Without a weight-update hook
        the post-update functions run last, over all parameters (a class may batch its own).
        """
        hook = getattr(self, "_weight_update_hook", None)
        rows = []  # (p, group, state, raw_grad, momentum input)
        settings = []
        for group in self.param_groups:
            self._init_group(group)
            kwargs = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                self._apply_weight_decay_inplace(p, grad, group["lr"], group["weight_decay"])
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - group["momentum"])
                rows.append((p, group, state, grad, grad.lerp(buf, group["momentum"]) if self.nesterov else buf))
                settings.append(kwargs)
        if not rows:
            return None
        with fp32_matmul_precision(self.fp32_matmul_prec):
            orth = self._orthogonalize_all([(r[0], r[4]) for r in rows], settings)
        for (p, group, state, raw_grad, pre_orth), orth_grad in zip(rows, orth):
            update = self._hook_update(p, orth_grad, group, state, raw_grad, pre_orth)
            self.pre_weight_update_fn_inplace(p, update)
            hook_state = None if hook is None else hook.pre_weight_update_inplace(p, update)
            p.add_(update, alpha=-group["lr"])
            if hook is not None:
                self.post_weight_update_fn_inplace(p)
                hook.post_weight_update_inplace(p, hook_state)
        if hook is None:
            self._post_weight_update_batch([r[0] for r in rows])
        return None


EOExtensionPoints._fused_hook_defaults = {name: EOExtensionPoints.__dict__[name] for name in BASE_HOOK_NAMES}


# The weight-decay methods of EO's per-parameter step (``_apply_weight_decay_inplace``).
EO_WEIGHT_DECAY_METHODS = ("decoupled", "independent", "l2", "palm")


def _nonzero(value) -> bool:
    """``value != 0`` for a group's weight decay, as EO tests it (a tensor is read, as EO reads it)."""
    return bool(value != 0.0)
