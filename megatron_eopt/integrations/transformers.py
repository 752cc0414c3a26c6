"""Hugging Face ``transformers.Trainer`` with Muon on the hidden matrices and AdamW on the rest.

Trainer builds its optimizer from ``optimizer_cls_and_kwargs``; when the first element is not a
``torch.optim.Optimizer`` subclass, Trainer treats it as a factory: it instantiates it and calls
the instance with the model and the keyword arguments. :class:`MuonAdamWFactory` is such a factory::

    from megatron_eopt.integrations.transformers import MuonAdamWFactory

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      optimizer_cls_and_kwargs=(MuonAdamWFactory, dict(lr=0.02, adamw_lr=3e-4)))

It routes the model's parameters with :func:`megatron_eopt.route_parameters` (2-D hidden matrices
to Muon; embeddings, output heads, norms, biases and N-D tensors to AdamW) and returns one
:class:`megatron_eopt.optim.HybridMuon`, so Trainer's learning-rate scheduler, gradient clipping,
checkpointing (``optimizer.pt``) and resuming see a single optimizer. Trainer's
``args.learning_rate`` and ``args.weight_decay`` do not reach a factory: give the values here.

Outside Trainer's factory path, ``build_muon_adamw(model, ...)`` returns the same optimizer (for
``Trainer(optimizers=(optimizer, None))`` or a hand-written loop).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..optim.hybrid import HybridMuon
from ..param_routing import DEFAULT_EMBEDDING_PATTERNS, DEFAULT_HEAD_PATTERNS, route_parameters

__all__ = ["MuonAdamWFactory", "build_muon_adamw"]


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
    verbose: bool = False,
    **muon_kwargs: Any,
) -> HybridMuon:
    """One :class:`HybridMuon` for ``model``: Muon (``lr``, ``momentum``, ``nesterov``,
    ``weight_decay``, ``scale_mode`` — √max(1, m/n) by default, the scale lr ≈ 0.02 is tuned
    for — and any other :class:`megatron_eopt.optim.Muon` keyword) on the 2-D hidden matrices,
    AdamW (``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay`` on matrices, none
    on 0-D / 1-D tensors) on the rest. ``verbose=True`` prints the routing table.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    table, routed = route_parameters(
        model, weight_decay=weight_decay, adamw_weight_decay=adamw_weight_decay,
        embedding_patterns=embedding_patterns, head_patterns=head_patterns, adamw_patterns=adamw_patterns,
    )
    adamw_wd = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    groups = [
        {"params": routed["muon"], "use_muon": True, "weight_decay": weight_decay},
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
