"""Which (out, in) matrices each weight of a model holds, read from its modules' types and config.

Muon orthogonalizes the matrices a layer multiplies by. ``nn.Linear`` stores one such matrix as
(out, in), but Hugging Face models also store weights other ways, and Muon given the stored tensor
would orthogonalize or scale the wrong thing:

- ``Conv1D`` (GPT-2 and its family) stores (in, out): ``matrix_layout="in_out"``, so the
  shape-dependent scale is that of (out, in) (``c_fc``: 2, not 1).
- Fused QKV projections are three matrices: GPT-2's ``c_attn`` ([Q | K | V] columns), GPT-NeoX's
  and Falcon's ``query_key_value`` (per head, or per KV group), Phi-3's ``qkv_proj``. They are split
  as Megatron splits its ``linear_qkv``: Q, K and V each orthogonalized as one matrix of all its
  heads (``split_shapes``: the sizes of one group's rows).
- transformers 5 stores the experts of an MoE layer as 3-D parameters (``gate_up_proj`` (E, 2I, H),
  ``down_proj`` (E, H, I); gpt-oss transposed, with gate and up interleaved): each expert is its own
  matrix (``nd_mode="batch"``). The fused gate/up is split into gate and up by default
  (``fused_gate_up="split"``): a model whose gate and up are separate ``nn.Linear`` (Llama, the
  shared experts of DeepSeek-V3) gets exactly that, so the update does not depend on whether an
  implementation fuses them. ``"whole"`` orthogonalizes the fused (2I, H) matrix, as Megatron-LM
  does with its ``linear_fc1``.
- MLA's low-rank projections (DeepSeek-V3: ``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
  ``kv_b_proj``) are orthogonalized whole, each factor its own matrix, as Moonlight and Kimi K2
  (which trained MLA models with Muon) and Megatron-LM's MLA do.
- MoE routers ((E, H) gates) go to AdamW by default (``routers="adamw"``): a router's rows are the
  experts' logits, an output layer over experts whose row norms set the routing, which
  orthogonalization would equalize; Moonlight / Kimi K2 and torchtitan's MoE recipes keep them off
  Muon. ``routers="muon"`` gives them to Muon as plain matrices (Megatron-LM's choice).

Detection is by module class and its attributes (transformers' ``use_experts_implementation``
flags ``is_transposed`` / ``is_concatenated`` / ``has_gate``, the attention modules' head
counts), not by parameter name alone. :func:`model_matrix_views` returns the view of every
parameter it recognizes; :func:`megatron_eopt.route_parameters` applies them where the traced
forward (:mod:`megatron_eopt.param_use`) has not read the weight's use, or agrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

__all__ = ["FUSED_GATE_UP_MODES", "ROUTER_MODES", "MatrixView", "model_matrix_views"]

FUSED_GATE_UP_MODES = ("split", "whole")
ROUTER_MODES = ("adamw", "muon")


@dataclass(frozen=True)
class MatrixView:
    """How one parameter is seen as Muon matrices: the param-group keys of
    :mod:`megatron_eopt.optim` (``nd_mode``, ``matrix_layout``, ``split_shapes``) and what it is."""

    kind: str  # "linear", "conv1d", "fused_qkv", "fused_gate_up", "experts", "mla", "router", "expert_bias",
    # "not_matrix", "nd"
    what: str  # said in the routing table
    nd_mode: str = "error"
    matrix_layout: str = "out_in"
    split_shapes: tuple[int, ...] | None = None
    optimizer: str = "muon"  # "adamw" for routers (by default) and experts' biases

    @property
    def is_plain(self) -> bool:
        """True for an (out, in) 2-D matrix orthogonalized whole (no group keys needed)."""
        return self.nd_mode == "error" and self.matrix_layout == "out_in" and self.split_shapes is None

    def group_keys(self) -> dict[str, Any]:
        """The param-group keys that give this view to a Muon of megatron_eopt.optim."""
        keys: dict[str, Any] = {}
        if self.nd_mode != "error":
            keys["nd_mode"] = self.nd_mode
        if self.matrix_layout != "out_in":
            keys["matrix_layout"] = self.matrix_layout
        if self.split_shapes is not None:
            keys["split_shapes"] = list(self.split_shapes)
        return keys

    def matrices(self, shape: tuple[int, ...]) -> tuple[int, list[tuple[int, int]]]:
        """(count, [(out, in) of each part]) for a parameter of ``shape``: ``count`` matrices (experts)
        each made of those parts."""
        if self.nd_mode == "flatten" and len(shape) > 2:  # one matrix (size(0), -1), as the optimizers view it
            rest = 1
            for s in shape[1:]:
                rest *= s
            shape = (shape[0], rest)
        count = 1
        for s in shape[:-2]:
            count *= s
        out, inp = (shape[-1], shape[-2]) if self.matrix_layout == "in_out" else (shape[-2], shape[-1])
        if self.split_shapes is None:
            return count, [(out, inp)]
        groups = out // sum(self.split_shapes)
        return count, [(groups * s, inp) for s in self.split_shapes]

    def describe(self, shape: tuple[int, ...]) -> str:
        count, parts = self.matrices(shape)
        body = " + ".join(f"{o}x{i}" for o, i in parts)
        if len(parts) > 3 and len(set(parts)) == 1:  # a 2-D stack of per-expert matrices
            body = f"[{len(parts)} parts of {parts[0][0]}x{parts[0][1]}]"
        elif len(parts) > 1:
            body = f"[{body}]"
        return f"{count} x {body}" if count > 1 or self.nd_mode == "batch" else body


def _kind(module: nn.Module) -> str:
    return type(module).__name__


def _from_transformers(module: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def _experts_flags(module: nn.Module) -> tuple[bool, bool] | None:
    """(is_transposed, is_concatenated) of a transformers experts module, None for other modules."""
    if hasattr(module, "is_transposed") and hasattr(module, "has_gate"):
        return bool(module.is_transposed), bool(getattr(module, "is_concatenated", True))
    if _kind(module).endswith("Experts") and any(p.dim() == 3 for p in module.parameters(recurse=False)):
        # transformers' default layout is (E, out, in), gate and up concatenated; a module without
        # the flags whose gate_up_proj is (E, hidden, 2I) stores (E, in, out) (Llama 4's experts)
        hidden = getattr(module, "hidden_size", None)
        gate_up = getattr(module, "gate_up_proj", None)
        transposed = isinstance(hidden, int) and isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and \
            gate_up.shape[1] == hidden != gate_up.shape[2]
        return transposed, True
    return None


def _experts_views(module: nn.Module, fused_gate_up: str) -> dict[str, MatrixView]:
    transposed, concatenated = _experts_flags(module)
    layout = "in_out" if transposed else "out_in"
    where = f"{_kind(module)}, {'(E, in, out)' if transposed else '(E, out, in)'}"
    views: dict[str, MatrixView] = {}
    for name, p in module.named_parameters(recurse=False):
        if p.dim() != 3:
            views[name] = MatrixView("expert_bias", f"expert bias ({_kind(module)})", optimizer="adamw")
        elif name == "gate_up_proj":
            out = p.shape[-1] if transposed else p.shape[-2]
            if fused_gate_up == "split" and out % 2 == 0:
                sizes = (out // 2, out // 2) if concatenated else (1, 1)
                order = "gate; up" if concatenated else "gate, up interleaved"
                views[name] = MatrixView("experts", f"experts, fused gate/up split ({order}; {where})", "batch",
                                         layout, sizes)
            else:
                views[name] = MatrixView("experts", f"experts, fused gate/up whole ({where})", "batch", layout)
        elif name in ("up_proj", "down_proj"):
            views[name] = MatrixView("experts", f"experts ({where})", "batch", layout)
    return views


def _gpt2_qkv(parent: nn.Module, weight: torch.Tensor) -> tuple[int, ...] | None:
    size = getattr(parent, "split_size", None)
    if not isinstance(size, int) or size <= 0:
        return None
    out = weight.shape[1]  # Conv1D: (in, out)
    if out == 3 * size:
        return (size, size, size)
    if out == 2 * size:  # cross-attention: K and V (Q is q_attn)
        return (size, size)
    return None


def _fused_qkv(parent: nn.Module, attr: str, weight: torch.Tensor) -> tuple[tuple[int, ...], str] | None:
    """Split sizes of a fused QKV ``nn.Linear`` (out, in) of a known attention module, and its rule."""
    kind = _kind(parent)
    rows = weight.shape[0]
    if attr == "query_key_value" and kind.startswith("GPTNeoX"):
        hd = getattr(parent, "head_size", None)
        if isinstance(hd, int) and rows % (3 * hd) == 0:
            return (hd, hd, hd), "fused QKV, per head [q; k; v] (GPT-NeoX)"
    if attr == "query_key_value" and kind.startswith("Falcon"):
        nh, hd = getattr(parent, "num_heads", None), getattr(parent, "head_dim", None)
        if not isinstance(nh, int) or not isinstance(hd, int):
            return None
        if getattr(parent, "new_decoder_architecture", False):
            nkv = getattr(parent, "num_kv_heads", nh)
            sizes = (nh // nkv * hd, hd, hd)
            rule = "fused QKV, per KV group [q...; k; v] (Falcon, new decoder architecture)"
        elif getattr(parent, "multi_query", False):
            sizes, rule = (nh * hd, hd, hd), "fused QKV [Q; k; v] (Falcon, multi-query)"
        else:
            sizes, rule = (hd, hd, hd), "fused QKV, per head [q; k; v] (Falcon)"
        return (sizes, rule) if rows % sum(sizes) == 0 else None
    if attr == "qkv_proj" and kind.startswith("Phi3"):
        config = getattr(parent, "config", None)
        hd = getattr(parent, "head_dim", None)
        nh = getattr(config, "num_attention_heads", None)
        nkv = getattr(config, "num_key_value_heads", None) or nh
        if isinstance(hd, int) and isinstance(nh, int) and rows == (nh + 2 * nkv) * hd:
            return (nh * hd, nkv * hd, nkv * hd), "fused QKV [Q; K; V] (Phi-3)"
    return None


def _is_mla(parent: nn.Module) -> bool:
    config = getattr(parent, "config", None)
    return getattr(parent, "kv_lora_rank", None) is not None or getattr(config, "kv_lora_rank", None) is not None


_MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _is_router(module: nn.Module, parent: nn.Module | None, attr: str) -> bool:
    if "router" in _kind(module).lower():
        return True
    # A gate Linear of a sparse-MoE block: one row per expert of its sibling experts module.
    experts = getattr(parent, "experts", None) if parent is not None else None
    weight = getattr(module, "weight", None)
    if attr in ("gate", "router") and isinstance(experts, nn.Module) and isinstance(weight, torch.Tensor):
        count = getattr(experts, "num_experts", None)
        if count is None and isinstance(experts, nn.ModuleList):
            count = len(experts)
        return weight.dim() == 2 and weight.shape[0] == count
    return False


# Weights of two or more dims in transformers modules whose forward uses them elementwise or as a
# lookup (AdamW without a trace too), or as matrices their stored shape does not say.
_NOT_MATRICES = (
    ("Mixer", ("A_log", "D", "dt_bias", "dt_proj_bias")),  # Mamba's mixers: A = -exp(A_log), (d, N) or (heads, d, N)
    ("XLNetRelativeAttention", ("r_w_bias", "r_r_bias", "r_s_bias", "seg_embed")),  # added / a lookup
    ("RecurrentGemmaRglru", ("input_gate_bias", "recurrent_gate_bias")),  # added in baddbmm
    ("", ("relative_position_bias_table",)),  # Swin, Donut, ...: indexed by relative position
)


def _known_parameters(module: nn.Module, own: Mapping[str, torch.Tensor]) -> dict[str, MatrixView]:
    kind = _kind(module)
    views: dict[str, MatrixView] = {}
    for suffix, names in _NOT_MATRICES:
        if kind.endswith(suffix):
            for name in names:
                if name in own and own[name].dim() >= 2:
                    views[name] = MatrixView("not_matrix", f"not a matrix ({kind}.{name}: elementwise or a lookup)",
                                             optimizer="adamw")
    if kind == "XLNetRelativeAttention":  # einsum("ibh,hnd->ibnd", x, q): one (in, out) matrix (d, heads·hd)
        for name in ("q", "k", "v", "r", "o"):
            if name in own and own[name].dim() == 3:
                views[name] = MatrixView("nd", f"one matrix d_model x heads·head_dim ({kind}, einsum)", "flatten",
                                         "out_in" if name == "o" else "in_out")
    if kind == "RecurrentGemmaRglru":  # baddbmm(bias, x, W[h]): one (in, out) matrix per head
        for name in ("input_gate_weight", "recurrent_gate_weight"):
            if name in own and own[name].dim() == 3:
                views[name] = MatrixView("experts", f"one matrix per head, (heads, in, out) ({kind})", "batch", "in_out")
    return views


def check_view_options(fused_gate_up: str, routers: str) -> None:
    """ValueError naming the option unless ``fused_gate_up`` and ``routers`` are known values."""
    if fused_gate_up not in FUSED_GATE_UP_MODES:
        raise ValueError(f"fused_gate_up must be one of {list(FUSED_GATE_UP_MODES)}, got {fused_gate_up!r}")
    if routers not in ROUTER_MODES:
        raise ValueError(f"routers must be one of {list(ROUTER_MODES)}, got {routers!r}")


def model_matrix_views(model: nn.Module, *, fused_gate_up: str = "split",
                       routers: str = "adamw") -> dict[int, tuple[str, MatrixView]]:
    """{id(param): (name, view)} for every parameter of a recognized module (see the module
    docstring); parameters of other modules are not listed (plain rules apply to them)."""
    check_view_options(fused_gate_up, routers)
    modules = dict(model.named_modules(remove_duplicate=False))
    out: dict[int, tuple[str, MatrixView]] = {}

    def put(prefix: str, name: str, p: torch.Tensor, view: MatrixView) -> None:
        out.setdefault(id(p), (f"{prefix}.{name}" if prefix else name, view))

    for prefix, module in modules.items():
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        parent_name, _, attr = prefix.rpartition(".")
        parent = modules.get(parent_name) if prefix else None
        if _experts_flags(module) is not None:
            for name, view in _experts_views(module, fused_gate_up).items():
                put(prefix, name, own[name], view)
            continue
        if _from_transformers(module):
            for name, view in _known_parameters(module, own).items():
                put(prefix, name, own[name], view)
        weight = own.get("weight")
        if weight is None or weight.dim() != 2:
            continue
        if _is_router(module, parent, attr):
            label = f"MoE router ({_kind(module)}, routers={routers!r})"
            put(prefix, "weight", weight, MatrixView("router", label, optimizer=routers))
        elif _kind(module) == "Conv1D" and _from_transformers(module):
            sizes = _gpt2_qkv(parent, weight) if parent is not None and attr == "c_attn" else None
            if sizes is not None:
                what = "fused QKV [Q | K | V] columns (Conv1D, (in, out))" if len(sizes) == 3 else \
                    "fused KV [K | V] columns (Conv1D, (in, out))"
                put(prefix, "weight", weight, MatrixView("fused_qkv", what, matrix_layout="in_out", split_shapes=sizes))
            else:
                put(prefix, "weight", weight, MatrixView("conv1d", "Conv1D, (in, out)", matrix_layout="in_out"))
        elif parent is not None and (qkv := _fused_qkv(parent, attr, weight)) is not None:
            put(prefix, "weight", weight, MatrixView("fused_qkv", qkv[1], split_shapes=qkv[0]))
        elif parent is not None and attr == "gate_up_proj" and _kind(parent).startswith("Phi3"):
            half = weight.shape[0] // 2
            if fused_gate_up == "split" and weight.shape[0] % 2 == 0:
                put(prefix, "weight", weight, MatrixView("fused_gate_up", "fused gate/up split [gate; up] (Phi-3)",
                                                         split_shapes=(half, half)))
            else:
                put(prefix, "weight", weight, MatrixView("fused_gate_up", "fused gate/up whole (Phi-3)"))
        elif parent is not None and attr in _MLA_PROJECTIONS and _is_mla(parent):
            put(prefix, "weight", weight, MatrixView("mla", f"MLA low-rank projection {attr} (whole)"))
    return out


def check_view_overrides(overrides: Mapping[str, Any] | None, names: set[str]) -> dict[str, MatrixView | None]:
    """``views=`` of the routing functions: {parameter name: MatrixView, a dict of its fields, or
    None (plain rules)}; a name that is not a parameter of the model is a ValueError."""
    if not overrides:
        return {}
    out: dict[str, MatrixView | None] = {}
    for name, view in overrides.items():
        if name not in names:
            close = sorted(n for n in names if n.endswith(name.rsplit(".", 1)[-1]))[:3]
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise ValueError(f"views names {name!r}, which is not a parameter of the model{hint}")
        if view is None or isinstance(view, MatrixView):
            out[name] = view
        elif isinstance(view, Mapping):
            fields = dict(view)
            fields.setdefault("kind", "override")
            fields.setdefault("what", "views= override")
            if "split_shapes" in fields and fields["split_shapes"] is not None:
                fields["split_shapes"] = tuple(fields["split_shapes"])
            try:
                out[name] = MatrixView(**fields)
            except TypeError as exc:
                raise ValueError(f"views[{name!r}]: {exc}") from None
        else:
            raise TypeError(f"views[{name!r}] must be a MatrixView, a dict of its fields or None, got "
                            f"{type(view).__name__}")
    return out
