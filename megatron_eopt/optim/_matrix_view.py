"""How a param group's weights are seen as the (out, in) matrices Muon orthogonalizes.

Two opt-in param-group keys, set by the model-aware routing (``megatron_eopt.model_views``) or by hand:

- ``matrix_layout``: ``"out_in"`` (default; ``nn.Linear``, Megatron) or ``"in_out"``: the weight is
  stored transposed (Hugging Face's ``Conv1D``, gpt-oss's experts). Newton–Schulz commutes with the
  transpose, so the stored matrix is orthogonalized as it is; what the layout changes is what is
  defined on the (out, in) matrix: the shape-dependent Muon scale, the side a split runs along, and
  the side NorMuon keeps its statistic on.
- ``split_shapes``: the output rows of a fused projection, viewed as (groups, sum(split_shapes), in)
  and split along the middle dim, each part orthogonalized (and scaled) as one matrix of
  ``groups · size`` rows: Megatron's ``qkv_split_shapes`` rule (docs/design.md §4.8). A fused QKV
  (GPT-2's ``c_attn``: ``(d, d, d)``; GPT-NeoX, per head: ``(hd, hd, hd)``) or a fused gate/up
  (``(I, I)``, or ``(1, 1)`` when interleaved).

Both combine with ``nd_mode="batch"`` (a split per expert of a fused (E, 2I, H) weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

MATRIX_LAYOUTS = ("out_in", "in_out")
VIEW_KEYS = ("matrix_layout", "split_shapes")


@dataclass(frozen=True)
class GroupMatrixView:
    transposed: bool = False
    split_shapes: tuple[int, ...] | None = None


def group_matrix_view(group: Mapping[str, Any]) -> GroupMatrixView:
    """The (checked) view keys of a param group."""
    layout = group.get("matrix_layout", "out_in")
    sizes = group.get("split_shapes")
    return GroupMatrixView(layout == "in_out", None if sizes is None else tuple(int(s) for s in sizes))


def check_matrix_view_keys(group: Mapping[str, Any], where: str) -> None:
    """ValueError naming the key when a group's ``matrix_layout`` or ``split_shapes`` is not one."""
    layout = group.get("matrix_layout", "out_in")
    if layout not in MATRIX_LAYOUTS:
        raise ValueError(f"{where}['matrix_layout'] must be one of {list(MATRIX_LAYOUTS)}, got {layout!r}")
    sizes = group.get("split_shapes")
    if sizes is None:
        return
    ok = isinstance(sizes, (list, tuple)) and len(sizes) > 0 and all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
    if not ok:
        raise ValueError(f"{where}['split_shapes'] must be a non-empty list of positive ints (the row sizes of one "
                         f"group of a fused projection), got {sizes!r}")


def split_newton_schulz(config, x: torch.Tensor, split,
                        scaled: bool) -> torch.Tensor:
    """Newton–Schulz of a (k, m, n) stack of fused projections, part by part (each part scaled when
    ``scaled``). A projection stored (in, out) is split along its columns: orthogonalized as its
    transpose, whose rows the split op takes, and returned stored as the input is."""
    if split.columns:
        xt = x.mT.contiguous()
        return config.newton_schulz_split(xt, split.sizes, xt.shape[-2] // split.total, scaled=scaled).mT.contiguous()
    return config.newton_schulz_split(x, split.sizes, x.shape[-2] // split.total, scaled=scaled)
