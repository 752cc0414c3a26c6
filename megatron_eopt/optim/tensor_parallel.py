"""Megatron-LM's TensorParallelMuon / TensorParallelAdaptiveMuon on the fused step.

Parameters are routed as in megatron/core/optimizer/emerging_optimizers.py: the TP group is
``pg_collection.expt_tp`` for ``p.expert_tp`` parameters and ``pg_collection.tp`` otherwise; the
sharded dimension is ``p.partition_dim`` (-1 or missing: not sharded). tp_mode:

- blockwise: every rank orthogonalizes its local shard; scale from the local shape.
- duplicated: all-gather along partition_dim, full Newton–Schulz, keep the local chunk; scale from
  the global shape.
- distributed: Newton–Schulz on the shards with all-reduced norm and Gram matrices; scale from the
  global shape. Meant for parameters sharded along their long side; one sharded along its short
  side is orthogonalized as in duplicated mode instead (same result, far less communication).
- layer_sharded (ours, after Megatron-LM's layer-sharded Muon proposal, PR #6683): each matrix is gathered whole onto one rank of
  the group, its home (the least loaded by Newton–Schulz FLOPs), orthogonalized there in batches of
  ``ns_batch_size`` same-shape matrices, and its shards are sent back: one all-to-all each way per
  chunk of matrices, every matrix orthogonalized once in the group. Results equal duplicated mode.

- auto (Megatron-LM PR #6664): per dense weight, duplicated or distributed, whichever a cost model
  of the step (:func:`~megatron_eopt.optim.multirank.tp_modes.auto_tp_mode_seconds`: Newton–Schulz
  FLOPs, halved Gram products with ``use_syrk``, the all-gather against the per-iteration Gram
  all-reduces, on the device's hardware profile or ``tp_mode_hardware``) finds faster; expert
  parameters always duplicated, as Megatron-LM's rule has it. ``tp_modes()`` tells what each
  parameter got.

``expert_tp_mode`` (None: ``tp_mode``) is the mode of ``expert_tp`` parameters, e.g. layer-sharded
experts beside duplicated dense weights. Parameters not sharded over their group are orthogonalized
on every rank in every mode.

Fused QKV projections (``split_qkv`` and ``is_qkv_fn(p)``) are orthogonalized per part, with
``p.qkv_split_shapes`` or ``qkv_split_shapes``; per head with ``split_qkv_per_head``; gated FC1 weights
(``split_glu``, ``p.is_glu``) as gate and up: see :mod:`~megatron_eopt.optim.projection_splits`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.optim.optimizer import ParamsT

from .._megatron_version import megatron_emerging_source
from ..coefficients import NS_EPS, NS_EPS_EO_030
from ._config import fused_config
from ._recipe import NSRecipe
from ..low_memory_state import DEFAULT_BLOCK_SIZE
from .step.grouping import DEFAULT_WORKSPACE_MIB
from .multirank.cost_model import AUTO_CANDIDATES, auto_tp_mode, group_span
from .multirank.hardware import HARDWARE, Hardware, hardware_of
from .multirank.layer_homes import HomeDomain, combined_peers
from .multirank.tp_modes import GTPLayout, TPLayout
from .projection_splits import LOCAL, WHOLE, ProjectionSplits, megatron_default, projection_shapes
from .adaptive_muon import AdaptiveMuon
from .orthogonalized import OrthogonalizedOptimizer

TP_MODES = ("blockwise", "duplicated", "distributed", "layer_sharded", "auto")


class _TensorParallelRouting(ProjectionSplits):
    """TP layout and fused-projection split of each parameter, as Megatron's TensorParallelMuon decides them."""

    pg_collection: Any
    tp_mode: str

    def _set_routing(self, split_qkv, is_qkv_fn, qkv_split_shapes, pg_collection, tp_mode, expert_tp_mode=None,
                     ns_batch_size=1, auto=None, split_qkv_per_head=False, split_glu=False) -> None:
        """``auto``: (num_ns_steps, use_syrk, precision, candidates, hardware or None) for tp_mode "auto"."""
        if tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode must be one of {list(TP_MODES)}, got {tp_mode!r}")
        if expert_tp_mode is not None and expert_tp_mode not in TP_MODES:
            raise ValueError(f"expert_tp_mode must be None or one of {list(TP_MODES)}, got {expert_tp_mode!r}")
        if isinstance(ns_batch_size, bool) or not isinstance(ns_batch_size, int) or ns_batch_size < 1:
            raise ValueError(f"ns_batch_size must be an int >= 1 (matrices per Newton–Schulz call on a layer-sharded "
                             f"home), got {ns_batch_size!r}")
        self._set_splits(split_qkv, is_qkv_fn, qkv_split_shapes, split_qkv_per_head, split_glu)
        self.pg_collection = pg_collection
        self.tp_mode = tp_mode
        self.expert_tp_mode = expert_tp_mode
        self.ns_batch_size = ns_batch_size
        self._auto = auto if auto is not None else (5, False, "medium", AUTO_CANDIDATES, None)

    def _tp_group(self, p: torch.Tensor):
        pg = self.pg_collection
        if not pg:
            return None
        return getattr(pg, "expt_tp", None) if getattr(p, "expert_tp", False) else getattr(pg, "tp", None)

    def _tp_mode_of(self, p: torch.Tensor) -> str:
        if getattr(p, "expert_tp", False) and self.expert_tp_mode is not None:
            mode = self.expert_tp_mode
        else:
            mode = self.tp_mode
        return self._auto_mode(p) if mode == "auto" else mode

    def _auto_mode(self, p: torch.Tensor) -> str:
        """tp_mode "auto" for p: experts duplicated (Megatron-LM's rule is for dense weights), a dense
        weight sharded over its group by :func:`auto_tp_mode`. The choice depends only on the global
        shape, the group's size, the step's settings and the hardware profile (all alike on every rank
        of the group; the device's profile too unless a group mixes GPU models), so every rank makes the
        same one; the ranks also agree at construction on the plan's digest, which holds each entry's
        mode, and refuse to step otherwise."""
        if getattr(p, "expert_tp", False):
            return "duplicated"
        partition_dim = getattr(p, "partition_dim", None)
        group = self._tp_group(p)
        if partition_dim not in (0, 1) or p.dim() != 2 or group is None:
            return "duplicated"  # not sharded over a group: orthogonalized whole, the mode unused
        size = dist.get_world_size(group)
        if size <= 1:
            return "duplicated"
        shape = list(p.shape)
        pg = self.pg_collection
        gtp_group = getattr(pg, "gtp_remat", None) if getattr(p, "is_gtp_weight_remat", False) else None
        if gtp_group is not None and dist.get_world_size(gtp_group) > 1:  # the tensor-parallel local rows
            shape[0] = shape[0] * dist.get_world_size(gtp_group) - int(getattr(p, "pad_length", 0))
        num_ns_steps, use_syrk, precision, candidates, hw = self._auto
        return auto_tp_mode(shape[partition_dim] * size, shape[1 - partition_dim], size, num_ns_steps, use_syrk,
                            p.element_size(), hw if hw is not None else hardware_of(p.device), precision, candidates,
                            span=group_span(dist.get_process_group_ranks(group)))

    def tp_modes(self) -> dict[int, str]:
        """{index of the parameter in ``param_groups`` order: the tensor-parallel mode its update runs
        in}: "duplicated", "distributed", "layer_sharded" or "blockwise" for a parameter sharded over
        its group (with tp_mode "auto", the mode chosen for it; a parameter distributed mode runs as
        duplicated, being sharded along its short side, is "duplicated"; with "layer_sharded" also a
        matrix replicated over its TP group, which gets one home), "replicated" for one orthogonalized
        whole on every rank (not sharded, or a group of one rank)."""
        modes = {}
        params = (p for group in self.param_groups for p in group["params"])
        for index, p in enumerate(params):
            layout = self._tp_layout(p)
            if layout is not None:
                modes[index] = layout.mode
            elif self._home_domain(p) is not None:  # replicated over TP (or GTP rows only): one home
                modes[index] = "layer_sharded"
            elif ((self._tp_mode_of(p) == "blockwise" or self._split_need(p) == LOCAL)
                  and getattr(p, "partition_dim", None) in (0, 1)
                  and self._tp_group(p) is not None and dist.get_world_size(self._tp_group(p)) > 1):
                modes[index] = "blockwise"
            else:
                modes[index] = "replicated"
        return modes

    def _tp_layout(self, p: torch.Tensor) -> TPLayout | None:
        mode = self._tp_mode_of(p)
        need = self._split_need(p)
        if need == LOCAL:  # a per-head split whose heads are whole on every rank: each its own
            return None
        if need == WHOLE and mode not in ("duplicated", "layer_sharded"):
            mode = "duplicated"  # the split cuts the local rows: orthogonalized on the gathered matrix
        if mode == "blockwise":
            return None
        partition_dim = getattr(p, "partition_dim", None)
        if partition_dim is None or partition_dim == -1:
            return None
        group = self._tp_group(p)
        if group is None:
            return None
        size = dist.get_world_size(group)
        if size <= 1:
            return None
        if partition_dim not in (0, 1):
            raise ValueError(f"partition_dim of a 2-D parameter must be 0, 1 or -1, got {partition_dim}")
        if mode == "distributed":
            shape = list(p.shape)
            gtp = self._gtp_layout(p)
            if gtp is not None and not gtp.blockwise:  # the tensor-parallel local matrix: GTP's real rows
                shape[0] = gtp.real_rows(shape[0])
            sharded, other = shape[partition_dim] * size, shape[1 - partition_dim]
            if sharded < other:
                # Sharded along the short side, the distributed iteration would all-reduce Gram
                # matrices of the long side every step (Megatron warns it wastes compute): one
                # all-gather of the shards is cheaper and gives the same result.
                mode = "duplicated"
        return TPLayout(group, size, dist.get_rank(group), int(partition_dim), mode,
                        self.ns_batch_size if mode == "layer_sharded" else 0)

    def _gtp_layout(self, p: torch.Tensor) -> GTPLayout | None:
        """Megatron-LM's GTP weight rematerialization: ``is_gtp_weight_remat`` parameters are sharded
        along their rows over ``pg_collection.gtp_remat`` (``expt_gtp_remat`` for ``expert_tp``),
        ``pad_length`` trailing rows of the gathered matrix being padding."""
        pg = self.pg_collection
        if not pg or not getattr(p, "is_gtp_weight_remat", False):
            return None
        group = getattr(pg, "expt_gtp_remat" if getattr(p, "expert_tp", False) else "gtp_remat", None)
        if group is None or dist.get_world_size(group) <= 1:
            return None
        pad = getattr(p, "pad_length", 0)
        if isinstance(pad, bool) or not isinstance(pad, int):
            raise ValueError(f"pad_length of a GTP-sharded parameter must be an int, got {pad!r}")
        # A gated FC1's gate and up, and heads, are split on the gathered rows in every mode (PR #6688);
        # so is a QKV whose query groups a GTP shard cuts.
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        kind = self._split_kind(p)
        blockwise = self._tp_mode_of(p) == "blockwise" and kind not in ("glu", "per_head")
        if blockwise and kind == "qkv":
            try:
                total = sum(projection_shapes(p, self.qkv_split_shapes))
            except (ValueError, TypeError):
                total = 0  # the plan's own call raises, naming p
            blockwise = total <= 0 or GTPLayout(group, size, rank, pad, True).real_rows(int(p.shape[0])) % total == 0
        return GTPLayout(group, size, rank, pad, blockwise)

    def _gtp_size(self, p: torch.Tensor) -> int:
        gtp = self._gtp_layout(p)
        return 1 if gtp is None else gtp.size

    def _tp_rows(self, p: torch.Tensor) -> tuple[int, int, int]:
        """(rows of p's tensor-parallel local matrix, without GTP padding; the ranks sharing its rows;
        this rank's index among them)."""
        rows = int(p.shape[0])
        gtp = self._gtp_layout(p)
        if gtp is not None:
            rows = gtp.real_rows(rows)
        group = self._tp_group(p)
        if getattr(p, "partition_dim", None) == 0 and group is not None and dist.get_world_size(group) > 1:
            return rows, dist.get_world_size(group), dist.get_rank(group)
        return rows, 1, 0

    def _home_domain(self, p: torch.Tensor) -> HomeDomain | None:
        """tp_mode "layer_sharded" over Megatron-LM's GTP x TP domain (PR #6683's homes): where the
        parameter's GTP group (``gtp_remat``, ``expt_gtp_remat`` for experts) has several ranks, or it is
        a 2-D matrix replicated over a TP group of several ranks (MLA down-projections, a router), each
        matrix gets one home among the TP x GTP ranks (multirank.layer_homes); None where the TP group's
        own homes decide (TP shards, no GTP group) or in the other modes."""
        if self._tp_mode_of(p) != "layer_sharded" or p.dim() != 2:
            return None
        group = self._tp_group(p)
        tp_size = 1 if group is None else dist.get_world_size(group)
        tp_sharded = getattr(p, "partition_dim", None) in (0, 1) and tp_size > 1
        pg = self.pg_collection
        gtp_group = getattr(pg, "expt_gtp_remat" if getattr(p, "expert_tp", False) else "gtp_remat", None) if pg else None
        if gtp_group is not None and dist.get_world_size(gtp_group) <= 1:
            gtp_group = None
        if gtp_group is None and (tp_sharded or tp_size <= 1):
            return None
        gtp = self._gtp_layout(p)  # the rows split over GTP, or None: replicated over it
        return HomeDomain(group if tp_size > 1 else None, tp_size, dist.get_rank(group) if tp_size > 1 else 0,
                          int(p.partition_dim) if tp_sharded else -1, gtp_group,
                          1 if gtp_group is None else dist.get_world_size(gtp_group),
                          0 if gtp_group is None else dist.get_rank(gtp_group), None if gtp is None else gtp.pad_rows,
                          self.ns_batch_size, self._combined_domain_group(p, group, gtp_group))

    def _combined_domain_group(self, p: torch.Tensor, tp_group, gtp_group) -> tuple | None:
        """PR #6683's group of a whole TP x GTP domain (``pg_collection.tp_gtp_remat``,
        ``expt_tp_gtp_remat`` for experts) with each member's rank in it, where the model has one and
        both groups have several ranks: the homes' exchanges then take one all-to-all over it instead
        of a relay over TP then GTP. Read once per set of groups (one object all-gather over GTP)."""
        if tp_group is None or gtp_group is None or dist.get_world_size(tp_group) <= 1:
            return None
        name = "expt_tp_gtp_remat" if getattr(p, "expert_tp", False) else "tp_gtp_remat"
        combined = getattr(self.pg_collection, name, None)
        if combined is None or dist.get_world_size(combined) <= 1:
            return None
        cache = self.__dict__.setdefault("_combined_peers", {})
        key = (id(tp_group), id(gtp_group), id(combined))
        if key not in cache:
            cache[key] = (combined, combined_peers(tp_group, gtp_group, combined, name))
        return cache[key]


def megatron_ns_eps(use_syrk: bool) -> float:
    """The Newton–Schulz normalization floor of Megatron-LM's tensor-parallel classes: 1e-7 (the
    Emerging-Optimizers 0.2.0 / 0.3.0 that megatron-core 0.18, 0.19 and main pin), 1e-15 with
    ``use_syrk=True`` (main refuses it below Emerging-Optimizers 0.4.0, whose floor that is)."""
    return NS_EPS if use_syrk is True else NS_EPS_EO_030


class TensorParallelMuon(_TensorParallelRouting, OrthogonalizedOptimizer):
    """Megatron-LM's ``TensorParallelMuon`` (same constructor and defaults: nesterov on, decoupled decay).

    ``use_decoupled_weight_decay=False`` selects L2 decay. ``custom_coefficient_sets`` (an
    extension) gives the rows of ``coefficient_type="custom"``. Without ``pg_collection`` every
    parameter is orthogonalized locally. State: ``momentum_buffer``. ``state_dtype`` /
    ``state_block_size``, ``workspace_mib``, ``overlap_backward`` and the 2026 recipe's ``row_equilibration``, ``frobenius_renorm``,
    ``ns_eps_mode``, ``ns_norm_divisor`` (extensions, inside the Newton–Schulz ops; QKV parts each
    their own matrix; not with ``tp_mode="distributed"``) as in :class:`~megatron_eopt.optim.Muon`.
    ``use_syrk`` (Megatron-LM main's switch for its SYRK kernel): True runs the Newton–Schulz ops
    with symmetric products (the symmetric kernel or lower block panels), False lets them choose by
    measurement (``ns_products="full"``, an extension, forces one GEMM each); the results agree to
    float rounding. ``ns_batch_size`` and ``expert_tp_mode`` (extensions: the layer-sharded mode's batch
    and the mode of expert parameters): see the module docstring. ``tp_mode_hardware`` (an extension):
    the hardware profile tp_mode "auto" prices the modes on, a :class:`~megatron_eopt.optim.multirank.
    hardware.Hardware` or a name of ``HARDWARE`` ("H100", "H200", "B200", "CPU"); None: the device's.

    ``split_qkv_per_head`` (Megatron-LM PR #6326 / #7085: each head's q, k, v its own matrix; needs
    ``split_qkv``) and ``split_glu`` (PR #6688: a gated FC1 tagged ``is_glu`` as gate and up), keyword
    arguments here: None takes the installed megatron-core's default (False where it has no such
    argument, as 0.19). See :mod:`~megatron_eopt.optim.projection_splits`.

    ``ns_eps`` (an extension; None: as Megatron-LM, :func:`megatron_ns_eps`) is the Frobenius
    normalization floor of Newton–Schulz: 1e-7, the Emerging-Optimizers release Megatron-LM pins, or
    1e-15 with ``use_syrk=True``, which Megatron-LM main runs only on Emerging-Optimizers >= 0.4.
    The floor matters only for updates of norm below it (shrunk instead of orthogonalized).
    """

    # Megatron-LM's classes: arguments and params are checked at construction, as before.
    _eo_step_time_errors = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: list[int] | None = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Any | None = None,
        tp_mode: str = "duplicated",
        use_syrk: bool = False,
        *,
        split_qkv_per_head: bool | None = None,
        split_glu: bool | None = None,
        ns_batch_size: int = 1,
        expert_tp_mode: str | None = None,
        tp_mode_hardware: Hardware | str | None = None,
        ns_products: str = "auto",
        custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
        state_dtype: str = "fp32",
        state_block_size: int = DEFAULT_BLOCK_SIZE,
        workspace_mib: float | str | None = DEFAULT_WORKSPACE_MIB,
        row_equilibration: bool = False,
        frobenius_renorm: bool = False,
        ns_eps_mode: str = "clamp",
        ns_norm_divisor: float = 1.0,
        overlap_backward: bool = False,
        ns_eps: float | None = None,
    ) -> None:
        self._init_tensor_parallel(locals(), moment2=None)

    def _init_tensor_parallel(self, arguments: dict, moment2: tuple[str, float, float] | None) -> None:
        """The constructors' common body: ``arguments`` are a constructor's ``locals()``; ``moment2`` is
        (moment2_method, beta2, eps) for the adaptive class, None for Muon."""
        a = arguments
        weight_decay_method = "decoupled" if a["use_decoupled_weight_decay"] else "l2"
        # Megatron-LM's classes refuse bad values at construction, and run Emerging-Optimizers'
        # newton_schulz_tp with its default eps: megatron-core 0.18 / 0.19 pin EO 0.2.0, main 0.3.0,
        # both 1e-7; main's use_syrk=True needs EO >= 0.4, whose eps is 1e-15.
        ns_eps = a["ns_eps"] if a["ns_eps"] is not None else megatron_ns_eps(a["use_syrk"])
        config, _ = fused_config(a, defer=False, weight_decay_method=weight_decay_method,
                                 moment2_method=None if moment2 is None else moment2[0], ns_eps=ns_eps)
        plain_recipe = config.recipe.op_arguments == NSRecipe().op_arguments
        if "distributed" in (a["tp_mode"], a["expert_tp_mode"]) and not plain_recipe:
            raise ValueError("row_equilibration, frobenius_renorm, ns_eps_mode and ns_norm_divisor do not apply with "
                             "tp_mode='distributed'")
        hardware = a["tp_mode_hardware"]
        if isinstance(hardware, str):
            if hardware not in HARDWARE:
                raise ValueError(f"tp_mode_hardware must be None, a Hardware or one of {sorted(HARDWARE)}, "
                                 f"got {hardware!r}")
            hardware = HARDWARE[hardware]
        elif hardware is not None and not isinstance(hardware, Hardware):
            raise ValueError(f"tp_mode_hardware must be None, a Hardware or one of {sorted(HARDWARE)}, "
                             f"got {hardware!r}")
        # tp_mode "auto" with the recipe's extensions (which distributed mode has not) chooses duplicated.
        candidates = AUTO_CANDIDATES if plain_recipe else ("duplicated",)
        auto = (config.num_ns_steps, a["use_syrk"] is True, config.precision, candidates, hardware)
        splits = {name: megatron_default(name) if a[name] is None else a[name]
                  for name in ("split_qkv_per_head", "split_glu")}
        self._set_routing(a["split_qkv"], a["is_qkv_fn"], a["qkv_split_shapes"], a["pg_collection"], a["tp_mode"],
                          a["expert_tp_mode"], a["ns_batch_size"], auto, **splits)
        defaults = dict(lr=a["lr"], momentum=a["momentum"], weight_decay=a["weight_decay"])
        if moment2 is not None:
            defaults.update(beta2=moment2[1], eps=moment2[2])
        self._init_fused(a["params"], defaults, config, state_dtype=a["state_dtype"],
                         state_block_size=a["state_block_size"], workspace_mib=a["workspace_mib"],
                         overlap_backward=a["overlap_backward"])


def _adaptive_arguments(
    self,
    params: ParamsT,
    lr: float = 3e-4,
    momentum: float = 0.95,
    nesterov: bool = True,
    weight_decay: float = 0.01,
    use_decoupled_weight_decay: bool = True,
    split_qkv: bool = False,
    is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
    qkv_split_shapes: list[int] | None = None,
    fp32_matmul_prec: str = "medium",
    coefficient_type: str = "quintic",
    num_ns_steps: int = 5,
    scale_mode: str = "spectral",
    extra_scale_factor: float = 1.0,
    pg_collection: Any | None = None,
    tp_mode: str = "duplicated",
    use_syrk: bool = False,
    moment2_method: str = "adamuon",
    beta2: float = 0.95,
    eps: float = 1e-8,
    *,
    split_qkv_per_head: bool | None = None,
    split_glu: bool | None = None,
    ns_batch_size: int = 1,
    expert_tp_mode: str | None = None,
    tp_mode_hardware: Hardware | str | None = None,
    ns_products: str = "auto",
    custom_coefficient_sets: Sequence[Sequence[float]] | None = None,
    state_dtype: str = "fp32",
    state_block_size: int = DEFAULT_BLOCK_SIZE,
    workspace_mib: float | str | None = DEFAULT_WORKSPACE_MIB,
    row_equilibration: bool = False,
    frobenius_renorm: bool = False,
    ns_eps_mode: str = "clamp",
    ns_norm_divisor: float = 1.0,
    overlap_backward: bool = False,
    ns_eps: float | None = None,
) -> None:
    """TensorParallelAdaptiveMuon's arguments, in Megatron-LM main's positional order."""


# The positional arguments after tp_mode: Megatron-LM main's order (use_syrk, #6381, then the second
# moment's); megatron-core 0.18 / 0.19 have no use_syrk and take moment2_method right after tp_mode.
ADAPTIVE_TAIL_MAIN = ("use_syrk", "moment2_method", "beta2", "eps")


def positional_tail(names: Sequence[str]) -> tuple[str, ...] | None:
    """The names after ``tp_mode`` in a positional argument list; None without ``tp_mode``."""
    names = list(names)
    return tuple(names[names.index("tp_mode") + 1:]) if "tp_mode" in names else None


def installed_adaptive_tail() -> tuple[str, ...] | None:
    """The positional arguments after ``tp_mode`` of the installed megatron-core's
    ``TensorParallelAdaptiveMuon`` (its imported class if megatron-core's module is loaded, else its
    source, parsed), or None where there is no megatron-core or no such class."""
    import ast
    import inspect
    import sys

    module = sys.modules.get("megatron.core.optimizer.emerging_optimizers")
    cls = getattr(module, "TensorParallelAdaptiveMuon", None)
    if cls is not None and not issubclass(cls, _TensorParallelRouting):
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return positional_tail(n for n, p in inspect.signature(cls).parameters.items() if p.kind in kinds)
    try:
        source = megatron_emerging_source()
        tree = ast.parse(source) if source is not None else None
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == "TensorParallelAdaptiveMuon":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return positional_tail(a.arg for a in item.args.posonlyargs + item.args.args)
    return None


def adaptive_signature(tail: Sequence[str] | None) -> inspect.Signature:
    """TensorParallelAdaptiveMuon's signature with ``tail`` (names of :data:`ADAPTIVE_TAIL_MAIN`) the
    positional arguments after ``tp_mode``, the others of that tuple keyword-only. None, or a tail with
    a name ours does not know: main's order."""
    if tail is None or not set(tail) <= set(ADAPTIVE_TAIL_MAIN) or len(set(tail)) != len(tail):
        tail = ADAPTIVE_TAIL_MAIN
    parameters = list(inspect.signature(_adaptive_arguments).parameters.values())
    by_name = {p.name: p for p in parameters}
    head = [p for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ADAPTIVE_TAIL_MAIN]
    positional = [by_name[n] for n in tail]
    keyword = [by_name[n].replace(kind=inspect.Parameter.KEYWORD_ONLY) for n in ADAPTIVE_TAIL_MAIN if n not in tail]
    keyword += [p for p in parameters if p.kind is p.KEYWORD_ONLY]
    return inspect.Signature(head + positional + keyword, return_annotation=None)


class TensorParallelAdaptiveMuon(TensorParallelMuon, AdaptiveMuon):
    """Megatron-LM's ``TensorParallelAdaptiveMuon``: TensorParallelMuon with AdaptiveMuon's second moment.

    Numerics follow Emerging-Optimizers' AdaptiveMuon (normalize the raw NS output, then scale);
    sharded parameters in duplicated / distributed mode use global statistics, so the result
    equals the unsharded one. NorMuon's ``moment2_buffer`` is the local slice of the global
    reduced buffer (its averaged dimension is chosen from the global shape). ``moment2_method``
    also accepts "namo" (not with ``use_decoupled_weight_decay=False``). State:
    ``momentum_buffer``, ``moment2_buffer``.

    Positional arguments follow the installed megatron-core's class: after ``tp_mode``, Megatron-LM
    main takes ``use_syrk, moment2_method, beta2, eps``, megatron-core 0.18 / 0.19 ``moment2_method,
    beta2, eps`` (``use_syrk`` then keyword-only); without megatron-core, main's order.
    ``inspect.signature`` shows the order in force (:data:`POSITIONAL_TAIL`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = _ADAPTIVE_SIGNATURE.bind(self, *args, **kwargs)  # TypeError as Python gives for a def
        bound.apply_defaults()
        a = bound.arguments
        self._init_tensor_parallel(dict(a), moment2=(a["moment2_method"], a["beta2"], a["eps"]))


_ADAPTIVE_SIGNATURE = adaptive_signature(installed_adaptive_tail())
TensorParallelAdaptiveMuon.__init__.__signature__ = _ADAPTIVE_SIGNATURE
# The positional arguments after tp_mode in force (the installed megatron-core's order, else main's).
TensorParallelAdaptiveMuon.POSITIONAL_TAIL = positional_tail(
    n for n, p in _ADAPTIVE_SIGNATURE.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD)
