"""QK-clip as Motif's parallel Muon defines it (the Motif lineage of ``megatron_eopt.muon``).

Motif's rule differs from :class:`megatron_eopt.optim.HybridMuon`'s exact per-head rule (see
``megatron_eopt.optim.qk_clip``); a model trained with Motif keeps its numbers by one import:

- The target weights are the Muon parameters whose name parses with :func:`parse_qk_layer`: the
  second-to-last dotted part is ``wq``, ``wk``, ``q_proj`` or ``k_proj`` (or MLA's ``wq_b`` /
  ``wkv_b``), the layer is the last all-digit part of the name.
- ``qk_logits[layer]`` (a dict by layer or a list indexed by layer) is read *positionally*: logit
  ``j`` belongs to query head ``q_indices[j]`` for a query weight and to key head
  ``k_indices[j]`` (an index of the key / kv heads) for a key weight. Heads not listed are never
  scaled, so a config without indices clips nothing, and no ``clip_config`` leaves ``qk_logits``
  unused.
- Where ``logits[j] > threshold`` the rows of that head are multiplied by
  ``sqrt(threshold / logits[j])`` (the smallest such factor when a head is listed twice, as a
  GQA ``k_indices`` such as ``[0, 0, 1, 1]`` does). Query and key are scaled independently, so a
  key head shared by several query heads takes the strongest clip of its group and the other
  query heads' logits shrink too: that is Motif's behaviour, kept here.
- MLA (DeepSeek-style, ``clip_config`` with ``qk_nope_head_dim``, ``qk_rope_head_dim`` and
  ``v_head_dim``): per head, ``wq_b`` holds ``qk_nope_head_dim`` rows then ``qk_rope_head_dim``
  rows and ``wkv_b`` holds ``qk_nope_head_dim`` key rows then ``v_head_dim`` value rows. With
  ``gamma = threshold / logit`` the query no-PE rows and key no-PE rows take ``sqrt(gamma)``, the
  query RoPE rows ``gamma`` (the key RoPE part is shared by all heads and stays), the value rows
  stay: each head's logit shrinks by exactly ``gamma`` (MuonClip, Kimi K2).
- Only parameters that have a gradient in the step are clipped (Motif skips the others).

Every check runs when the step starts, before any parameter or state changes; the factors are
computed on the device without a host sync and applied by the fused ``qk_clip_`` op after the
update, on the local rows of DTensor (FSDP2) weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..optim.multirank.dtensor_layout import is_dtensor
from ..optim.qk_clip import check_row_layout, scale_row_blocks_

# Second-to-last name part -> (query or key, MLA).
_KINDS = {"wq": ("q", False), "q_proj": ("q", False), "wk": ("k", False), "k_proj": ("k", False),
          "wq_b": ("q", True), "wkv_b": ("k", True)}
_CONFIG_KEYS = ("q_indices", "k_indices", "head_dim", "threshold", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim")


def parse_qk_layer(name: str) -> tuple[str | None, int]:
    """Motif's parser: ``(kind, layer)`` of a query / key projection weight's name, else
    ``(None, -1)``. The kind is the second-to-last dotted part (``wq``, ``wk``, ``q_proj``,
    ``k_proj``, MLA's ``wq_b`` / ``wkv_b``); the layer is the last all-digit part (-1 if none).
    Names of fewer than three parts are not projections. ``'model.3.attn.wq.weight'`` ->
    ``('wq', 3)``; ``'model.4.attn.v_proj.weight'`` -> ``(None, -1)``."""
    parts = name.split(".")
    if len(parts) < 3 or parts[-2] not in _KINDS:
        return None, -1
    layer = next((int(part) for part in reversed(parts) if part.isdigit()), -1)
    return parts[-2], layer


@dataclass(frozen=True)
class MotifClipConfig:
    """Motif's ``clip_config``: ``q_indices`` / ``k_indices`` (positional head lists, empty by
    default), ``head_dim``, ``threshold``; for MLA also ``qk_nope_head_dim``,
    ``qk_rope_head_dim`` and ``v_head_dim``."""

    q_indices: tuple[int, ...]
    k_indices: tuple[int, ...]
    head_dim: int | None
    threshold: float | None
    mla: tuple[int, int, int] | None  # (qk_nope_head_dim, qk_rope_head_dim, v_head_dim)

    @property
    def active(self) -> bool:
        return bool(self.q_indices or self.k_indices)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any] | None) -> "MotifClipConfig":
        if config is None:
            return cls((), (), None, None, None)
        if not isinstance(config, Mapping):
            raise TypeError(f"clip_config must be a dict or None, got {type(config).__name__}")
        unknown = sorted(set(config) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"clip_config has unknown keys {unknown} (known: {list(_CONFIG_KEYS)})")

        def indices(key):
            value = config.get(key) or ()
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
                raise ValueError(f"clip_config['{key}'] must be a list of non-negative ints, got {value!r}")
            return tuple(value)

        def positive_int(key, required):
            value = config.get(key)
            if value is None and not required:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"clip_config['{key}'] must be a positive int, got {value!r}")
            return value

        q, k = indices("q_indices"), indices("k_indices")
        active = bool(q or k)
        threshold = config.get("threshold")
        if active or threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                    math.isfinite(threshold) and threshold > 0):
                raise ValueError(f"clip_config['threshold'] must be a finite positive number, got {threshold!r}")
            threshold = float(threshold)
        head_dim = positive_int("head_dim", False)
        mla_keys = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        mla = None
        if any(config.get(key) is not None for key in mla_keys):
            mla = tuple(positive_int(key, True) for key in mla_keys)
        return cls(q, k, head_dim, threshold, mla)


@dataclass
class MotifClipTarget:
    """One weight Motif's QK-clip may scale."""

    param: torch.Tensor
    name: str
    kind: str  # "q" or "k"
    mla: bool
    layer: int


def find_targets(groups: Sequence[Mapping[str, Any]], config: MotifClipConfig) -> list[MotifClipTarget]:
    """The Muon parameters whose names parse as query / key weights; their shapes are checked
    against the config when clipping is on (ValueError at construction)."""
    targets = []
    for group in groups:
        if not group.get("use_muon") or "names" not in group:
            continue
        for p, name in zip(group["params"], group["names"]):
            kind, layer = parse_qk_layer(name)
            if kind is None:
                continue
            qk, mla = _KINDS[kind]
            target = MotifClipTarget(p, name, qk, mla, layer)
            if config.active:
                _check_target(target, config)
            targets.append(target)
    return targets


def _head_rows(target: MotifClipTarget, config: MotifClipConfig) -> int:
    if not target.mla:
        return config.head_dim
    nope, rope, v = config.mla
    return nope + (rope if target.kind == "q" else v)


def _check_target(target: MotifClipTarget, config: MotifClipConfig) -> None:
    name, p = target.name, target.param
    indices = config.q_indices if target.kind == "q" else config.k_indices
    if not indices:
        return
    if target.layer < 0:
        raise ValueError(f"{name}: a query / key weight without a layer number in its name cannot be matched to "
                         "qk_logits[layer]")
    if target.mla and config.mla is None:
        raise ValueError(f"{name}: MLA weights need clip_config['qk_nope_head_dim'], ['qk_rope_head_dim'] and "
                         "['v_head_dim']")
    if not target.mla and config.head_dim is None:
        raise ValueError("clip_config needs 'head_dim' (rows per head) when q_indices or k_indices are given")
    check_row_layout(p, name)
    rows = _head_rows(target, config)
    if p.shape[0] % rows != 0:
        raise ValueError(f"{name}: {p.shape[0]} rows are not a multiple of {rows} rows per head")
    heads = p.shape[0] // rows
    bad = [h for h in indices if h >= heads]
    if bad:
        key = "q_indices" if target.kind == "q" else "k_indices"
        raise ValueError(f"clip_config['{key}'] names heads {bad}, but {name} has {heads} heads")


def _layer_logits(qk_logits, layer: int, name: str, needed: int) -> torch.Tensor:
    if isinstance(qk_logits, Mapping):
        if layer not in qk_logits:
            raise ValueError(f"qk_logits has no entry for layer {layer} (of {name}); it has {sorted(qk_logits)}")
        logits = qk_logits[layer]
    elif isinstance(qk_logits, (list, tuple)):
        if not 0 <= layer < len(qk_logits):
            raise ValueError(f"qk_logits is a list of {len(qk_logits)} layers, but {name} is in layer {layer}")
        logits = qk_logits[layer]
    else:
        raise TypeError(f"qk_logits must be a dict {{layer: logits}} or a list indexed by layer, got "
                        f"{type(qk_logits).__name__}")
    if is_dtensor(logits):  # tensor-parallel logits: the full per-head vector, as Motif reads it
        logits = logits.full_tensor()
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1 or not logits.is_floating_point():
        raise ValueError(f"qk_logits[{layer}] must be a 1-D float tensor of per-head max logits, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.shape[0] < needed:
        raise ValueError(f"qk_logits[{layer}] has {logits.shape[0]} values, but clip_config lists {needed} heads "
                         f"for {name}")
    return logits


def plan_motif_clip(targets: Sequence[MotifClipTarget], qk_logits, config: MotifClipConfig):
    """Checks ``qk_logits`` and computes the row factors of every target with a gradient:
    ``(weights, factors, block_rows)`` for :func:`scale_row_blocks_`, empty when nothing clips."""
    weights, factors, blocks = [], [], []
    if qk_logits is None or not config.active:
        return weights, factors, blocks
    tau = config.threshold
    for t in targets:
        indices = config.q_indices if t.kind == "q" else config.k_indices
        if not indices or t.param.grad is None:
            continue
        device = t.param.device
        logits = _layer_logits(qk_logits, t.layer, t.name, len(indices)).detach()
        rows = _head_rows(t, config)
        heads = t.param.shape[0] // rows
        # Motif's arithmetic: the fp32 logit read as a double, sqrt(tau / logit) in double.
        s = logits[: len(indices)].to(device=device, dtype=torch.float64)
        gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
        idx = torch.tensor(indices, dtype=torch.long, device=device)
        per_head = torch.ones(heads, dtype=torch.float64, device=device).scatter_reduce(0, idx, gamma, "amin")
        if not t.mla:
            weights.append(t.param)
            factors.append(per_head.sqrt().to(torch.float32))
            blocks.append(rows)
            continue
        nope, rope, v = config.mla
        second = per_head if t.kind == "q" else torch.ones_like(per_head)  # q RoPE rows: gamma; v rows: 1
        per_row = torch.cat([per_head.sqrt()[:, None].expand(heads, nope),
                             second[:, None].expand(heads, rope if t.kind == "q" else v)], dim=1)
        weights.append(t.param)
        factors.append(per_row.reshape(-1).to(torch.float32))
        blocks.append(1)
    return weights, factors, blocks


def apply_motif_clip(plan) -> None:
    """Scales the rows of a plan from :func:`plan_motif_clip` (after the update)."""
    weights, factors, blocks = plan
    if weights:
        scale_row_blocks_(weights, factors, blocks)
