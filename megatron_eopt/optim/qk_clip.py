"""QK-clip (MuonClip, Kimi K2): after the update, the query and key rows of every attention head
whose max logit ran past a threshold ``tau`` are scaled so the head's logits shrink by
``tau / logit``.

For a head ``h`` with recorded max logit ``s_h``, ``gamma_h = tau / s_h`` when ``s_h > tau``, else 1.
With as many key heads as query heads, the head's q rows and k rows are both multiplied by
``sqrt(gamma_h)`` (Motif's and Kimi's rule). With grouped-query attention a key head is shared by
the query heads of its group: its k rows are multiplied by ``sqrt(min gamma)`` over the group and
each query head's q rows by ``gamma_h / sqrt(min gamma)``, so every head's q.k product is scaled by
exactly ``gamma_h`` (and an unclipped head's logits are unchanged). Megatron's fused QKV weight
(per query group: the group's q heads, then its k head, then its v head, ``head_dim`` rows each) is
handled the same way, its v rows untouched.

The factors are computed with a few small tensor ops per layer, on the device of the weight they
scale; the rows of every weight of every layer are then scaled by one fused
:func:`megatron_eopt.qk_clip_` call per (device, dtype) (the op takes tensors of one device and one
dtype, and a model may spread its layers over several GPUs of one process). A DTensor weight
(FSDP2, tensor parallel) is scaled on its local shard: the factors of the rows the shard holds,
head blocks cut by a shard boundary (uneven shards) included, so the result equals scaling the
full weight.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from .. import ops
from .multirank.dtensor_layout import is_dtensor, placement_kind

# Parameter names: the layer index, and whether the weight is a query, key or fused QKV projection.
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")
_KINDS = (
    ("qkv", re.compile(r"(?:^|\.)(?:linear_qkv|qkv_proj|qkv|query_key_value|c_attn|Wqkv|wqkv)\.weight$")),
    ("q", re.compile(r"(?:^|\.)(?:q_proj|wq|query|linear_q|to_q)\.weight$")),
    ("k", re.compile(r"(?:^|\.)(?:k_proj|wk|key|linear_k|to_k)\.weight$")),
)


@dataclass(frozen=True)
class ClipConfig:
    """Motif's ``clip_config``: ``threshold`` (tau), ``head_dim`` (rows per head), and optionally
    ``q_indices`` / ``k_indices``: the query heads whose logits are clipped (default: all heads;
    a key head is scaled when a query head of its group is)."""

    threshold: float
    head_dim: int
    q_indices: tuple[int, ...] | None = None
    k_indices: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, config: Mapping) -> "ClipConfig":
        if not isinstance(config, Mapping):
            raise TypeError(f"clip_config must be a dict, got {type(config).__name__}")
        unknown = set(config) - {"threshold", "head_dim", "q_indices", "k_indices"}
        if unknown:
            raise ValueError(f"clip_config has unknown keys {sorted(unknown)}")
        for key in ("threshold", "head_dim"):
            if key not in config:
                raise ValueError(f"clip_config needs '{key}'")
        threshold = float(config["threshold"])
        if not (math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"clip_config['threshold'] must be finite and positive, got {config['threshold']!r}")
        head_dim = config["head_dim"]
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"clip_config['head_dim'] must be a positive int, got {head_dim!r}")

        def indices(key):
            value = config.get(key)
            if value is None:
                return None
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
                raise ValueError(f"clip_config['{key}'] must be a list of non-negative ints, got {value!r}")
            return tuple(value)

        return cls(threshold, head_dim, indices("q_indices"), indices("k_indices"))


@dataclass
class ClipTarget:
    """One attention weight QK-clip scales: its layer, kind ("q", "k" or "qkv") and name."""

    param: torch.Tensor
    name: str
    layer: int
    kind: str


def parse_target(param: torch.Tensor, name: str) -> ClipTarget | None:
    """The QK-clip role of a parameter from its name, or None when it is not a q / k / qkv weight."""
    layer = _LAYER.search(name)
    if layer is None:
        return None
    for kind, pattern in _KINDS:
        if pattern.search(name):
            return ClipTarget(param, name, int(layer.group(1)), kind)
    return None


def _gammas(logits: torch.Tensor, config: ClipConfig) -> torch.Tensor:
    """Per query head: tau / logit where the logit exceeds tau (and the head is clipped), else 1."""
    logits = logits.detach().to(torch.float32)
    gamma = torch.where(logits > config.threshold, config.threshold / logits, torch.ones_like(logits))
    heads = logits.shape[0]
    selected = set(config.q_indices) if config.q_indices is not None else None
    if config.k_indices is not None:
        selected = (selected or set()) | set(config.k_indices)
    if selected is not None:
        gamma = torch.where(_head_mask(tuple(sorted(selected)), heads, logits.device), gamma, torch.ones_like(gamma))
    return gamma


# Head masks by (selected heads, heads, device): made once, outside any CUDA-graph capture (the first,
# eager step), so later steps index nothing from the host (a host-to-device copy breaks capture).
_HEAD_MASKS: dict[tuple, torch.Tensor] = {}


def _head_mask(selected: tuple[int, ...], heads: int, device: torch.device) -> torch.Tensor:
    key = (selected, heads, str(device))
    mask = _HEAD_MASKS.get(key)
    if mask is None:
        host = torch.zeros(heads, dtype=torch.bool)
        host[[i for i in selected if i < heads]] = True
        mask = _HEAD_MASKS[key] = host.to(device)
    return mask


def _factors(gamma: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q factor per query head, k factor per key head) for `kv_heads` key heads."""
    group = gamma.shape[0] // kv_heads
    k = gamma.view(kv_heads, group).amin(dim=1).sqrt()
    q = gamma / k.repeat_interleave(group)
    return q, k


def _check_logits(layer: int, logits, heads: int | None) -> torch.Tensor:
    if is_dtensor(logits):  # per-head logits sharded by tensor parallelism: the full vector
        logits = logits.full_tensor()
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1:
        raise ValueError(f"qk_logits[{layer}] must be a 1-D tensor of per-head max logits, got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if heads is not None and logits.shape[0] != heads:
        raise ValueError(f"qk_logits[{layer}] has {logits.shape[0]} values but layer {layer}'s query weight has "
                         f"{heads} heads")
    return logits


def plan_clip(targets: Sequence[ClipTarget], qk_logits: Mapping[int, torch.Tensor], config: ClipConfig):
    """Validates ``qk_logits`` against the clip targets (ValueError before anything changes) and
    returns (weights, factor vectors, block rows) for :func:`megatron_eopt.qk_clip_`."""
    by_layer: dict[int, dict[str, ClipTarget]] = {}
    for t in targets:
        by_layer.setdefault(t.layer, {})[t.kind] = t
    for layer in qk_logits:
        if layer not in by_layer:
            raise ValueError(f"qk_logits has layer {layer}, but no q / k / qkv weight of layer {layer} is known to "
                             f"the optimizer (known layers: {sorted(by_layer)})")
    d = config.head_dim
    weights, factors, blocks = [], [], []
    for layer, logits in qk_logits.items():
        kinds = by_layer[layer]
        if "qkv" in kinds:
            w = kinds["qkv"].param
            check_row_layout(w, kinds["qkv"].name)
            logits = _check_logits(layer, logits, None)
            heads = logits.shape[0]
            rows = w.shape[0]
            if rows % d != 0 or (rows // d - heads) % 2 != 0 or rows // d <= heads:
                raise ValueError(f"{kinds['qkv'].name}: {rows} rows do not hold {heads} query heads of "
                                 f"head_dim {d} plus key and value heads")
            groups = (rows // d - heads) // 2
            if heads % groups != 0:
                raise ValueError(f"{kinds['qkv'].name}: {heads} query heads do not split into {groups} groups")
            q, k = _factors(_gammas(logits.to(w.device), config), groups)
            per_group = torch.cat([q.view(groups, heads // groups), k.view(groups, 1), torch.ones_like(k).view(groups, 1)],
                                  dim=1)
            weights.append(w)
            factors.append(per_group.reshape(-1).contiguous())
            blocks.append(d)
            continue
        if "q" not in kinds or "k" not in kinds:
            raise ValueError(f"layer {layer} needs both a query and a key weight for QK-clip, found "
                             f"{sorted(kinds)}")
        wq, wk = kinds["q"].param, kinds["k"].param
        for t in (kinds["q"], kinds["k"]):
            check_row_layout(t.param, t.name)
            if t.param.shape[0] % d != 0:
                raise ValueError(f"{t.name}: {t.param.shape[0]} rows are not a multiple of head_dim {d}")
        heads, kv_heads = wq.shape[0] // d, wk.shape[0] // d
        logits = _check_logits(layer, logits, heads)
        if heads % kv_heads != 0:
            raise ValueError(f"layer {layer}: {heads} query heads do not split over {kv_heads} key heads")
        q, k = _factors(_gammas(logits.to(wq.device), config), kv_heads)
        weights += [wq, wk]
        factors += [q.to(wq.device).contiguous(), k.to(wk.device).contiguous()]
        blocks += [d, d]
    return weights, factors, blocks


def op_groups(keys: Sequence[tuple[torch.device, torch.dtype]]) -> list[list[int]]:
    """The indices of ``keys`` (each weight's ``(device, dtype)``) grouped by equal key, groups in
    order of first appearance and indices ascending within a group: one ``qk_clip_`` call each,
    since the op takes tensors of one device and one dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (device, dtype) in enumerate(keys):
        groups.setdefault((torch.device(device), dtype), []).append(i)
    return list(groups.values())


def check_row_layout(weight: torch.Tensor, name: str) -> None:
    """Refuses, before anything changes, a weight whose local rows are not one contiguous range of
    the full weight's rows (a DTensor strided-sharded along its rows)."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: QK-clip scales rows of 2-D weights, got shape {tuple(weight.shape)}")
    if is_dtensor(weight):
        for pl in weight.placements:
            if placement_kind(pl) == "strided" and pl.dim == 0:
                raise ValueError(f"{name}: rows strided-sharded ({pl}) hold no contiguous range of heads; "
                                 "QK-clip needs Shard(0), Shard(1) or Replicate placements")


def _local_rows(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the tensor holding this rank's rows, the index of its first row in the full weight)."""
    if not is_dtensor(weight):
        return weight, 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    return weight.to_local(), offset[0]


@torch.no_grad()
def scale_row_blocks_(weights: Sequence[torch.Tensor], factors: Sequence[torch.Tensor], block_rows: Sequence[int]):
    """``weights[i]`` (plain or DTensor) times ``factors[i]``, one fp32 value per block of
    ``block_rows[i]`` rows of the full weight, in place; one fused op call per (device, dtype).

    A shard whose rows start and end on block boundaries takes its slice of the factors; one cut
    inside a block (uneven shards, heads split across ranks) takes per-row factors."""
    locals_, local_factors, local_blocks = [], [], []
    for w, f, b in zip(weights, factors, block_rows):
        t, start = _local_rows(w.detach())
        rows = t.shape[0]
        if rows == 0 or t.numel() == 0:
            continue
        if start % b == 0 and rows % b == 0:
            f, b = f[start // b:(start + rows) // b], b
        else:
            f, b = f.repeat_interleave(b)[start:start + rows], 1
        locals_.append(t)
        local_factors.append(f.to(t.device).contiguous())
        local_blocks.append(b)
    for idx in op_groups([(t.device, t.dtype) for t in locals_]):
        ops.qk_clip_([locals_[i] for i in idx], [local_factors[i] for i in idx], [local_blocks[i] for i in idx])


@torch.no_grad()
def apply_qk_clip(targets: Sequence[ClipTarget], qk_logits: Mapping[int, torch.Tensor], config: ClipConfig) -> None:
    """Scales the q / k rows of every clipped head (see the module docstring); one fused call per
    (device, dtype) of the weights, each weight's factors on its own device (no host sync)."""
    weights, factors, blocks = plan_clip(targets, qk_logits, config)
    scale_row_blocks_(weights, factors, blocks)


def max_attention_logits(q: torch.Tensor, k: torch.Tensor, softmax_scale: float | None = None,
                         causal: bool = False) -> torch.Tensor:
    """Per-head max attention logit for models that do not record it.

    ``q``: ``(batch, heads, seq_q, head_dim)``; ``k``: ``(batch, kv_heads, seq_k, head_dim)`` with
    ``heads`` a multiple of ``kv_heads`` (GQA). Logits are ``softmax_scale * q.k`` (default
    ``1 / sqrt(head_dim)``), masked above the diagonal when ``causal``. Returns ``(heads,)`` fp32.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (batch, heads, seq, head_dim), got {tuple(q.shape)} and {tuple(k.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads != 0:
        raise ValueError(f"q has {heads} heads, not a multiple of k's {kv_heads}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    with torch.no_grad():
        k = k.float().repeat_interleave(heads // kv_heads, dim=1)
        logits = torch.matmul(q.float(), k.transpose(-2, -1)) * scale
        if causal:
            sq, sk = logits.shape[-2], logits.shape[-1]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=logits.device).triu(1 + sk - sq)
            logits = logits.masked_fill(mask, float("-inf"))
        return logits.amax(dim=(0, 2, 3))
