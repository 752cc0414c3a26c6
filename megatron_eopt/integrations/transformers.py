"""Hugging Face ``transformers.Trainer`` with Muon on the hidden matrices and AdamW on the rest.

Trainer builds its optimizer from ``optimizer_cls_and_kwargs``; when the first element is not a
``torch.optim.Optimizer`` subclass, Trainer treats it as a factory: it instantiates it and calls
the instance with the model and the keyword arguments. :class:`MuonAdamWFactory` is such a factory::

    from megatron_eopt.integrations.transformers import MuonAdamWFactory

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=(MuonAdamWFactory, dict(lr=0.02, adamw_lr=3e-4)))

It routes the model's parameters with :func:`megatron_eopt.route_parameters` (hidden matrices to
Muon, each seen as the (out, in) matrices its forward multiplies by, read from one traced forward
on the model's dummy inputs or ``example_inputs`` and from its module classes: ``Conv1D`` weights stored (in,
out), fused QKV and gate/up projections split, MoE experts one matrix per expert, see
:mod:`megatron_eopt.model_views`; embeddings, output heads, norms, biases and routers to AdamW)
and returns one
:class:`megatron_eopt.optim.HybridMuon`, so Trainer's learning-rate scheduler, gradient clipping,
checkpointing (``optimizer.pt``) and resuming see a single optimizer. Trainer's
``args.learning_rate`` and ``args.weight_decay`` do not reach a factory: give the values here.

Outside Trainer's factory path, ``build_muon_adamw(model, ...)`` returns the same optimizer (for
``Trainer(optimizers=(optimizer, None))`` or a hand-written loop).

Trainer clips every gradient by one global norm (``max_grad_norm=1.0`` by default).
:class:`MuonClipMixin` (or the ready-made ``MuonClipTrainer = MuonClipMixin + Trainer``) replaces
that clip with :func:`megatron_eopt.clip_grad_norm_` at the same ``max_grad_norm``: by default only
the AdamW part is clipped, by its own norm, and the logged ``grad_norm`` is still the norm of all
gradients before clipping.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..clipping import DEFAULT_CLIP_POLICY
from ..optim.hybrid import HybridMuon
from ..param_routing import DEFAULT_EMBEDDING_PATTERNS, DEFAULT_HEAD_PATTERNS, route_parameters

__all__ = ["MuonAdamWFactory", "MuonClipMixin", "build_muon_adamw"]  # and MuonClipTrainer, built on first use


def build_muon_adamw(
    model: nn.Module,
    *,
    lr: float = 0.02,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.0,
    adamw_lr: float = 3e-4,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float | None = None,
    scale_mode: str = "shape_scaling",
    embedding_patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS,
    head_patterns: Sequence[str] = DEFAULT_HEAD_PATTERNS,
    adamw_patterns: Sequence[str] = (),
    fused_gate_up: str = "split",
    routers: str = "adamw",
    views: Mapping[str, Any] | None = None,
    verbose: bool = False,
    example_inputs: Any = None,
    **muon_kwargs: Any,
) -> HybridMuon:
    """One :class:`HybridMuon` for ``model``: Muon (``lr``, ``momentum``, ``nesterov``,
    ``weight_decay``, ``scale_mode`` — √max(1, m/n) by default, the scale lr ≈ 0.02 is tuned
    for — and any other :class:`megatron_eopt.optim.Muon` keyword) on the 2-D hidden matrices,
    AdamW (``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay`` on matrices, none
    on 0-D / 1-D tensors) on the rest. ``verbose=True`` prints the routing table (each parameter's
    optimizer, matrix view and scale). ``fused_gate_up`` (``"split"``: gate and up of a fused
    projection orthogonalized apart, as separate ``nn.Linear`` would be; ``"whole"``: together, as
    Megatron-LM's ``linear_fc1``), ``routers`` (``"adamw"`` or ``"muon"``), ``views`` and
    ``example_inputs`` (the forward traced to read each weight's use; None: the model's
    ``dummy_inputs``; False: no trace) are those of :func:`megatron_eopt.route_parameters`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    table, routed = route_parameters(
        model, weight_decay=weight_decay, adamw_weight_decay=adamw_weight_decay,
        embedding_patterns=embedding_patterns, head_patterns=head_patterns, adamw_patterns=adamw_patterns,
        fused_gate_up=fused_gate_up, routers=routers, views=views,
        scale_mode=scale_mode if isinstance(scale_mode, str) else "shape_scaling", example_inputs=example_inputs,
    )
    adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    groups = [
        dict(g, use_muon=True, weight_decay=weight_decay) for g in table.muon_groups
    ] + [
        {"params": routed["adamw_decay"], "use_muon": False, "weight_decay": adamw_wd},
        {"params": routed["adamw_no_decay"], "use_muon": False, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError("model has no trainable parameters")
    if verbose:
        table.print()
    return HybridMuon(
        groups, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, scale_mode=scale_mode,
        adamw_lr=adamw_lr, adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_weight_decay=adamw_wd,
        **muon_kwargs,
    )


class MuonAdamWFactory:
    """The ``optimizer_cls_and_kwargs`` factory of ``transformers.Trainer``: ``MuonAdamWFactory()(model,
    **kwargs)`` is :func:`build_muon_adamw` (see the module docstring)."""

    def __call__(self, model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
        return build_muon_adamw(model, **kwargs)


class MuonClipMixin:
    """Muon-aware gradient clipping for a ``transformers.Trainer`` subclass:
    ``class MyTrainer(MuonClipMixin, Trainer)``, or ``MuonClipTrainer``.

    Trainer's clip (``_clip_grad_norm``, called when ``args.max_grad_norm > 0``) becomes
    :func:`megatron_eopt.clip_grad_norm_` over the optimizer's parameters with
    ``policy=muon_clip_policy`` (a class attribute, ``"adamw"`` by default; ``"global"`` is
    Trainer's own clip, ``"separate"`` clips each part by its own norm) at ``args.max_grad_norm``.
    Its return value, the norm of all gradients before clipping, is what Trainer logs as
    ``grad_norm``; the parts of the last clip are kept as ``self.grad_norm_parts``
    (:class:`megatron_eopt.GradNorms`, tensors). fp16 gradients are unscaled by accelerate's
    ``unscale_gradients`` first, as accelerate's own clip does. DeepSpeed, FSDP1 and SageMaker
    model parallelism keep Trainer's own clip (their gradients are the engine's).
    """

    muon_clip_policy: str = DEFAULT_CLIP_POLICY
    grad_norm_parts: Any = None

    def _clip_grad_norm(self, model):  # Trainer's hook (transformers 5.x)
        from ..clipping import clip_grad_norm_

        accelerator = self.accelerator
        distributed = str(getattr(accelerator, "distributed_type", ""))
        if "DEEPSPEED" in distributed or ("FSDP" in distributed and not getattr(accelerator, "is_fsdp2", False)) \
                or getattr(self.args, "sagemaker_mp_enabled", False) or not hasattr(self, "optimizer"):
            return super()._clip_grad_norm(model)
        optimizer = self.optimizer
        while type(optimizer).__name__ == "AcceleratedOptimizer":
            optimizer = optimizer.optimizer  # accelerate's wrapper: the classes tell Muon's parameters
        accelerator.unscale_gradients()
        parts = clip_grad_norm_(optimizer, self.args.max_grad_norm, policy=self.muon_clip_policy, return_parts=True)
        self.grad_norm_parts = parts
        return parts.total


def __getattr__(name: str) -> Any:
    if name == "MuonClipTrainer":  # built on first use, so that importing this module needs no transformers
        import transformers

        cls = type("MuonClipTrainer", (MuonClipMixin, transformers.Trainer), {
            "__doc__": "``transformers.Trainer`` with :class:`MuonClipMixin`'s Muon-aware gradient clipping.",
            "__module__": __name__,
        })
        globals()["MuonClipTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
