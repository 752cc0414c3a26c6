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

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

# What a param of more than two dims is: refused ("error"), a batch of matrices over its leading
# dims ("batch": MoE experts (E, m, n)) or one matrix (size(0), -1) ("flatten": convolutions).
ND_MODES = ("error", "batch", "flatten")
MATRIX_LAYOUTS = ("out_in", "in_out")
VIEW_KEYS = ("matrix_layout", "split_shapes")


def batched_matrix_shape(shape: tuple[int, ...], nd_mode: str) -> tuple[int, ...]:
    """The matrix view of a param shape: 2-D as is; more dims: (size(0), -1) for "flatten",
    (prod(leading), m, n) for "batch"."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 2:
        return shape
    if nd_mode == "flatten":
        return (shape[0], math.prod(shape[1:]))
    return (math.prod(shape[:-2]), shape[-2], shape[-1])


def not_a_matrix(p: torch.Tensor, nd_mode: str) -> bool:
    """True when ``p`` has no matrix view under ``nd_mode`` (0-D / 1-D, or N-D with "error")."""
    return p.ndim < 2 or (p.ndim > 2 and nd_mode == "error")


def check_nd_mode(value: Any, where: str = "nd_mode") -> None:
    """ValueError naming ``where`` unless ``value`` is one of :data:`ND_MODES`."""
    if not isinstance(value, str) or value not in ND_MODES:
        raise ValueError(f"{where} must be one of {list(ND_MODES)}, got {value!r}")


@dataclass
class MatrixSplit:
    """A stored matrix holding several logical matrices: a fused projection viewed as
    (num_groups, sum(sizes), cols), split along dim 1 (docs/design.md §4.8). ``sizes``: the group's
    ``split_shapes`` (Megatron's ``qkv_split_shapes``).

    ``columns``: the projection is stored (in, out) (``matrix_layout="in_out"``: a Conv1D, a transposed
    expert), so its output rows are the stored matrix's columns and the split runs along them."""

    sizes: tuple[int, ...]
    local_groups: int  # query groups in the local rows
    global_groups: int  # query groups in the global (unsharded) rows
    columns: bool = False

    @property
    def total(self) -> int:
        return sum(self.sizes)


def matrix_split(sizes, local_shape, global_shape, where: str, columns: bool = False) -> MatrixSplit:
    """The checked :class:`MatrixSplit` of a matrix whose local and global views are given (the split
    runs along the output rows: the columns when ``columns``). ValueError naming ``where`` when the
    sizes are not positive or do not divide the rows. The messages keep Megatron's wording."""
    sizes = tuple(int(s) for s in sizes)
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"{where}: qkv_split_shapes must be positive sizes, got {list(sizes)}")
    total = sum(sizes)
    axis = -1 if columns else -2  # the projection's output rows (the last two dims are one matrix)
    if local_shape[axis] % total != 0:
        what = "columns (matrix_layout='in_out')" if columns else "rows"
        raise ValueError(
            f"{where}: QKV split shape mismatch: {what} {local_shape[axis]} of shape {tuple(local_shape)} are not a "
            f"multiple of sum(qkv_split_shapes) = {total} (split shapes {list(sizes)})"
        )
    return MatrixSplit(sizes, local_shape[axis] // total, global_shape[axis] // total, columns)


@dataclass(frozen=True)
class GroupViewKeys:
    transposed: bool = False
    split_shapes: tuple[int, ...] | None = None


def group_view_keys(group: Mapping[str, Any]) -> GroupViewKeys:
    """The (checked) view keys of a param group."""
    layout = group.get("matrix_layout", "out_in")
    sizes = group.get("split_shapes")
    return GroupViewKeys(layout == "in_out", None if sizes is None else tuple(int(s) for s in sizes))


def check_view_keys(group: Mapping[str, Any], where: str) -> None:
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
