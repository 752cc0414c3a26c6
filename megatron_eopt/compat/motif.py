"""Motif's parallel Muon (Motif-Technologies/optimizer) on :class:`megatron_eopt.optim.HybridMuon`
(served by ``megatron_eopt.muon``).

Motif (the Moonlight rule): SGD-style momentum ``buf = momentum·buf + g`` (Nesterov
``g + momentum·buf``), Newton–Schulz with the original quintic in bf16, decoupled weight decay
``p *= 1 - lr·wd`` and ``p -= lr·0.2·√max(m, n)·update``; AdamW for the rest. Newton–Schulz
normalizes its input, so the EMA momentum of the fused op (``(1 - momentum)`` times the SGD
buffer, exactly, from a zero start) gives the same updates; ``momentum_buffer`` holds the EMA.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

from ..optim.hybrid import HybridMuon
from ._deprecation import _warn_once

MOTIF_KEYS = ("adamw_betas", "adamw_eps", "none_grad", "debug", "clip_config", "warmup_step", "chunk_size",
              "use_distributed_muon", "expert_keys")
_SIMPLE = "simple"
# Names of parameters that stay with AdamW by default: embeddings, output heads, norms.
_ADAMW_NAMES = re.compile(r"(?:^|\.)(?:embed|embedding|embeddings|wte|wpe|tok_embeddings|lm_head|output|head|"
                          r"classifier|norm|ln_f|ln_\d|layernorm|layer_norm)\b", re.IGNORECASE)


def is_motif_call(params: list, kwargs: Mapping[str, Any]) -> bool:
    return any(k in kwargs for k in MOTIF_KEYS) or any(isinstance(g, Mapping) and "use_muon" in g for g in params)


def default_muon_param_groups(model: torch.nn.Module, is_muon_func: Callable[[str, torch.Tensor], bool] | None = None):
    """2-D (and N-D) hidden weights to Muon; embeddings, output heads (tied ones too), norms, biases
    and scalars to AdamW. Every group carries ``names``."""
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    muon, adamw = ([], []), ([], [])
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_muon_func is not None:
            use = bool(is_muon_func(name, p))
        else:
            use = p.ndim >= 2 and id(p) not in embedding_ids and not _ADAMW_NAMES.search(name)
        target = muon if use else adamw
        target[0].append(p)
        target[1].append(name)
    groups = []
    if muon[0]:
        groups.append({"params": muon[0], "names": muon[1], "use_muon": True})
    if adamw[0]:
        groups.append({"params": adamw[0], "names": adamw[1], "use_muon": False})
    return groups


def _split_experts(groups: list[dict], expert_keys) -> list[dict]:
    """Muon groups split into experts (names matching expert_keys: nd_mode "batch") and the rest
    (N-D tensors flattened like conv filters, as the snippets do)."""
    out = []
    for g in groups:
        if not g.get("use_muon") or "names" not in g:
            out.append(g)
            continue
        names, params = list(g["names"]), list(g["params"])
        is_expert = [any(k in n for k in (expert_keys or ())) for n in names]
        for flag, mode in ((True, "batch"), (False, "flatten")):
            idx = [i for i, e in enumerate(is_expert) if e == flag]
            if idx:
                out.append({**g, "params": [params[i] for i in idx], "names": [names[i] for i in idx],
                            "nd_mode": mode})
    return out


class MotifMuon(HybridMuon):
    """Motif's ``Muon(params, lr, momentum, nesterov, ns_steps, weight_decay, adamw_betas, adamw_eps,
    none_grad, debug, clip_config, warmup_step, chunk_size, use_distributed_muon, expert_keys)`` with
    ``step(closure=None, qk_logits=None)``. ``debug``, ``warmup_step``, ``chunk_size`` and
    ``use_distributed_muon`` tune Motif's own communication pipeline: accepted, with no effect here
    (DTensor parameters take the owner pipeline of the fused path)."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.1, adamw_betas=(0.9, 0.95), adamw_eps: float = 1e-8, none_grad: bool = True,
                 debug: bool = False, clip_config: Mapping[str, Any] | None = None, warmup_step: int = 5,
                 chunk_size: int = -1, use_distributed_muon: bool = False, expert_keys=None) -> None:
        groups = [dict(g) for g in params]
        self.none_grad = bool(none_grad)
        super().__init__(
            _split_experts(groups, expert_keys),
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            adamw_betas=tuple(adamw_betas),
            adamw_eps=adamw_eps,
            clip_config=clip_config,
            nesterov=nesterov,
            weight_decay_method="decoupled",
            fp32_matmul_prec="medium",
            coefficient_type=_SIMPLE,
            num_ns_steps=ns_steps,
            scale_mode="spectral",
            extra_scale_factor=0.2,
        )

    @torch.no_grad()
    def step(self, closure=None, qk_logits=None):
        loss = super().step(closure, qk_logits=qk_logits)
        if self.none_grad:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        return loss


def get_default_muon_param_groups(model: torch.nn.Module, is_muon_func: Callable[[str, Any], bool] | None = None):
    """Motif's default split: 2-D hidden matrices to Muon; embeddings, the output head, norms, biases
    and scalars to AdamW (``is_muon_func(name, param)`` decides instead when given). Every group
    gets ``names``."""
    _warn_once("get_default_muon_param_groups")
    return default_muon_param_groups(model, is_muon_func)
