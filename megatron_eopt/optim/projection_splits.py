"""Which fused projections of a Megatron-LM model the tensor-parallel classes split, and into what.

A split is a :class:`~megatron_eopt.optim.matrix_view.MatrixSplit` (docs/design.md §4.8): the rows of
a matrix viewed as (groups, sum(split_shapes), cols), each part orthogonalized as one matrix of
``groups · size`` rows. Megatron-LM's three fused projections are each that rule, on the matrix the
split is applied to:

- fused QKV (``split_qkv``): ``qkv_split_shapes`` per query group, ``[q, k, v]`` or
  ``[q, gate, k, v]``; MLA's up-projections by their ``qkv_layout`` tag (``projection_split_shapes``,
  e.g. ``(qk_head_dim, v_head_dim)`` per head of ``linear_kv_up_proj``).
- per head (``split_qkv_per_head``, Megatron-LM PR #6326 / #7085): every head's q, (gate,) k and v
  its own matrix: the split shapes of the whole matrix, one group (``qkv_layout.per_head_split_shapes``
  times its ``num_groups``, ``qkv_split_shapes_global``, or the model's heads).
- gated FC1 (``split_glu``, Megatron-LM PR #6688): a ``linear_fc1`` weight tagged ``is_glu`` holds
  ``[gate_r; up_r]`` on each tensor-parallel rank r (``glu_interleave_size`` s: blocks
  ``[g, u, g, u, ...]`` of s rows): split shapes ``(I/tp, I/tp)`` of the rank's rows (or ``(s, s)``).
  Gathered across the ranks the matrix is ``[gate_0; up_0; gate_1; up_1; ...]``: ``tp`` groups of the
  same split shapes, so the gate is every rank's gate rows and the up every rank's up rows.

Where the split is applied (:class:`SplitNeed`): a split whose parts are whole in each rank's rows
runs in every tp_mode; one whose local rows cut a query group or a head (tensor parallelism above the
number of query groups, heads crossing a rank's rows) needs the gathered matrix, so the parameter runs
as in duplicated mode (layer_sharded stays: it gathers too); a per-head split whose heads are whole on
every rank needs no communication at all (each rank orthogonalizes its own heads, as blockwise mode).
Under GTP weight rematerialization the split is defined on the tensor-parallel local matrix: the GTP
shards are gathered and the padding rows left out first, in every mode (blockwise too), as PR #6688
does for a gated FC1.
"""

from __future__ import annotations

import ast
import functools
import sys
from typing import Any, Callable, Sequence

import torch

from .._megatron_version import megatron_emerging_source

# Where a parameter's split is applied (None: no split, or one that fits every tp_mode).
WHOLE = "whole"  # on the matrix gathered over the tensor-parallel group
LOCAL = "local"  # on each rank's own rows, without tensor-parallel communication


def megatron_default(name: str) -> bool:
    """The default of argument ``name`` (``split_glu``, ``split_qkv_per_head``) of the installed
    megatron-core's ``TensorParallelMuon`` (its loaded class, else its source, parsed): False where it
    has no such argument (megatron-core 0.19) or there is no megatron-core, so that by default the
    classes split what the megatron-core in use splits."""
    module = sys.modules.get("megatron.core.optimizer.emerging_optimizers")
    cls = getattr(module, "TensorParallelMuon", None)
    if cls is not None and not issubclass(cls, ProjectionSplits):
        import inspect

        parameter = inspect.signature(cls).parameters.get(name)
        return parameter is not None and parameter.default is True
    try:
        source = megatron_emerging_source()
    except OSError:
        return False
    return source is not None and _source_defaults(source).get(name) is True


@functools.lru_cache(maxsize=4)
def _source_defaults(source: str) -> dict[str, Any]:
    """{argument: constant default} of ``TensorParallelMuon.__init__`` in emerging_optimizers.py's text."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TensorParallelMuon":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args.posonlyargs + item.args.args
                    pairs = list(zip([a.arg for a in args][len(args) - len(item.args.defaults):], item.args.defaults))
                    pairs += [(a.arg, d) for a, d in zip(item.args.kwonlyargs, item.args.kw_defaults)]
                    return {n: d.value for n, d in pairs if isinstance(d, ast.Constant)}
    return {}


def glu_split_shapes(rows: int, interleave: Any = None) -> tuple[int, int]:
    """The split shapes of a gated FC1's tensor-parallel local rows ``[gate; up]`` (``rows`` of them),
    or of its blocks ``[g, u, ...]`` of ``interleave`` rows each. ValueError when they do not divide."""
    if interleave is not None:
        if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave <= 0:
            raise ValueError(f"glu_interleave_size must be a positive int, got {interleave!r}")
        if rows % (2 * interleave) != 0:
            raise ValueError(f"GLU split: the {rows} tensor-parallel local rows of a gated linear_fc1 (is_glu) are "
                             f"not whole [gate, up] blocks of glu_interleave_size={interleave} rows each")
        return (interleave, interleave)
    if rows % 2 != 0:
        raise ValueError(f"GLU split: the {rows} tensor-parallel local rows of a gated linear_fc1 (is_glu) do not "
                         "halve into gate and up")
    return (rows // 2, rows // 2)


def _checked_sizes(sizes: Any, what: str) -> list[int]:
    ok = isinstance(sizes, (list, tuple)) and len(sizes) > 0 and all(
        isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
    if not ok:
        raise ValueError(f"{what} must be a non-empty list of positive ints, got {sizes!r}")
    return [int(s) for s in sizes]


def projection_shapes(p: torch.Tensor, fallback: Sequence[int] | None) -> list[int]:
    """Rows of one group of a fused QKV (or MLA up-projection): ``p.qkv_split_shapes``, else its
    ``qkv_layout.projection_split_shapes``, else ``fallback`` (the optimizer's ``qkv_split_shapes``)."""
    sizes = getattr(p, "qkv_split_shapes", None)
    layout = getattr(p, "qkv_layout", None)
    if sizes is None and layout is not None:
        sizes = getattr(layout, "projection_split_shapes", None)
    if sizes is None:
        sizes = fallback
    if sizes is None:
        raise ValueError("Muon QKV split requested but qkv_split_shapes is not set")
    return list(sizes)


def per_head_shapes(p: torch.Tensor, fallback: Sequence[int] | None) -> list[int]:
    """Rows of every head of the whole fused matrix, in order: ``p.qkv_layout``'s
    ``per_head_split_shapes`` times its ``num_groups``, else ``p.qkv_split_shapes_global``, else
    ``fallback`` (the optimizer's ``qkv_split_shapes``, the model's heads under ``split_qkv_per_head``)."""
    layout = getattr(p, "qkv_layout", None)
    if layout is not None and getattr(layout, "per_head_split_shapes", None) is not None:
        heads = _checked_sizes(list(layout.per_head_split_shapes), "qkv_layout.per_head_split_shapes")
        groups = getattr(layout, "num_groups", None)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
            raise ValueError(f"qkv_layout.num_groups must be a positive int, got {groups!r}")
        return heads * groups
    sizes = getattr(p, "qkv_split_shapes_global", None)
    if sizes is None:
        sizes = fallback
    if sizes is None:
        raise ValueError("Muon per-head QKV split requested but qkv_split_shapes is not set")
    return _checked_sizes(list(sizes), "the per-head qkv_split_shapes")


def heads_in(sizes: Sequence[int], start: int, rows: int) -> tuple[list[int], bool]:
    """The heads (``sizes``, laid end to end) meeting rows [start, start + rows), as the rows of each
    that fall inside, and whether every one of them is whole there."""
    out, whole, head_start = [], True, 0
    for size in sizes:
        lo, hi = max(head_start, start), min(head_start + size, start + rows)
        if lo < hi:
            out.append(hi - lo)
            whole = whole and hi - lo == size
        head_start += size
    return out, whole


def cuts_every_rank_on_a_boundary(sizes: Sequence[int], rows: int, ranks: int) -> bool:
    """Whether ``ranks`` consecutive blocks of ``rows`` rows each start and end on a boundary of ``sizes``."""
    bounds, at = {0}, 0
    for size in sizes:
        at += size
        bounds.add(at)
    return all(r * rows in bounds for r in range(ranks + 1))


class ProjectionSplits:
    """The split of each parameter of Megatron-LM's tensor-parallel classes (mixed into them).

    Set by :meth:`_set_splits`; the class it is mixed into (``optim.tensor_parallel``) supplies
    ``_tp_rows(p)`` -> (tensor-parallel local rows, ranks sharing the rows, this rank's index among
    them): the rows of the matrix the split is defined on, without GTP padding; and ``_gtp_size(p)``:
    the ranks of the GTP group p's rows are sharded over (1: none)."""

    _tp_rows: Callable[[torch.Tensor], tuple[int, int, int]]
    _gtp_size: Callable[[torch.Tensor], int]

    split_qkv: bool
    split_qkv_per_head: bool
    split_glu: bool
    is_qkv_fn: Callable[[torch.Tensor], bool] | None
    qkv_split_shapes: list[int] | None

    def _set_splits(self, split_qkv, is_qkv_fn, qkv_split_shapes, split_qkv_per_head, split_glu) -> None:
        for name, value in (("split_qkv_per_head", split_qkv_per_head), ("split_glu", split_glu)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if split_qkv and is_qkv_fn is None:
            raise ValueError("split_qkv=True needs is_qkv_fn (a callable telling which params are fused QKV)")
        if split_qkv_per_head and not split_qkv:
            raise ValueError("split_qkv_per_head requires split_qkv=True")
        self.split_qkv = bool(split_qkv)
        self.split_qkv_per_head = split_qkv_per_head
        self.split_glu = split_glu
        self.is_qkv_fn = is_qkv_fn
        self.qkv_split_shapes = None if qkv_split_shapes is None else list(qkv_split_shapes)

    def _split_kind(self, p: torch.Tensor) -> str | None:
        """"qkv", "per_head", "glu" or None: which split p takes."""
        if self.split_qkv and self.is_qkv_fn(p):
            return "per_head" if self.split_qkv_per_head else "qkv"
        if self.split_glu and getattr(p, "is_glu", False):
            return "glu"
        return None

    def _split_need(self, p: torch.Tensor) -> str | None:
        """Where p's split must be applied: :data:`WHOLE`, :data:`LOCAL`, or None (anywhere). A split
        that cannot be worked out gives None here; the plan's own call raises, naming p."""
        kind = self._split_kind(p)
        if kind is None or kind == "glu":
            return None
        try:
            rows, ranks, _ = self._tp_rows(p)
            if kind == "qkv":
                total = sum(projection_shapes(p, self.qkv_split_shapes))
                return None if total > 0 and rows % total == 0 else WHOLE
            heads = per_head_shapes(p, self.qkv_split_shapes)
        except (ValueError, TypeError):
            return None
        if ranks <= 1:
            return None
        # Heads whole on every rank: no communication. Under GTP the gathered matrix is split instead,
        # so that every rank of a group plans the same work.
        if not getattr(p, "is_gtp_weight_remat", False) and cuts_every_rank_on_a_boundary(heads, rows, ranks):
            return LOCAL
        return WHOLE

    def _split_shapes_of(self, p: torch.Tensor) -> list[int] | None:
        kind = self._split_kind(p)
        if kind is None:
            return None
        if kind == "qkv":
            return projection_shapes(p, self.qkv_split_shapes)
        rows, ranks, rank = self._tp_rows(p)
        if kind == "glu":
            # PR #6688 tags a GTP-sharded gated FC1 with the size of its GTP group: the rows to gather
            expected = getattr(p, "gtp_remat_size", None) if getattr(p, "is_gtp_weight_remat", False) else None
            if expected is not None and expected != self._gtp_size(p):
                raise ValueError(f"GLU split: gtp_remat_size={expected!r} of the gated linear_fc1, but its GTP group "
                                 f"(pg_collection.gtp_remat / expt_gtp_remat) has {self._gtp_size(p)} rank(s)")
            return list(glu_split_shapes(rows, getattr(p, "glu_interleave_size", None)))
        heads = per_head_shapes(p, self.qkv_split_shapes)
        if sum(heads) != rows * ranks:
            raise ValueError(f"per-head QKV split: the head sizes sum to {sum(heads)} rows, the fused matrix has "
                             f"{rows * ranks} ({ranks} x {rows} tensor-parallel local rows) (split shapes {heads})")
        if self._split_need(p) == LOCAL:
            return heads_in(heads, rank * rows, rows)[0]
        return heads
