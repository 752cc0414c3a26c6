"""The static grouping of an optimizer's parameters, built once per parameter set.

A step launches one fused op per *bucket* (param group, dtype, device) for momentum, second
moment and update, and one Newton–Schulz call per *stack* (matrices orthogonalized together:
same local shape and device, same QKV split, same tensor-parallel layout), within each *chunk*:
the entries whose Newton–Schulz buffers fit the optimizer's workspace budget together
(:func:`chunk_entries`), so a step's transient memory is bounded by the budget (or by the largest
matrix), not by the number of matrices. Building this needs
parameter attributes and process-group sizes, so it runs eagerly (construction, add_param_group,
load_state_dict), never inside a compiled step; a step only filters it by which grads exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...ops._quantized_state import draw_layout
from .._config import OrthogonalizationConfig
from ..matrix_view import MatrixSplit, group_view_keys, batched_matrix_shape, not_a_matrix, matrix_split
from ..multirank.dtensor_layout import ShardLayout, describe, is_dtensor, local
from ..multirank.tp_modes import GTPLayout, TPLayout


@dataclass
class ParamEntry:
    param: torch.Tensor
    group_index: int
    local_shape: tuple[int, ...]  # the local matrix view: (m, n), or (E, m, n) for nd_mode "batch"
    global_shape: tuple[int, int]  # the global shape of one matrix
    tp: TPLayout | None
    split: MatrixSplit | None
    # Scale handed to foreach_update_. Plain matrices: Muon scale of the global shape. QKV:
    # Muon scales each part itself (inside newton_schulz_split), AdaptiveMuon after the
    # second-moment normalization (part_scales), so the update scale is 1 there.
    update_scale: float
    part_scales: tuple[tuple[int, int, float], ...] = ()  # (row offset, rows, scale) per part
    normuon_dim: int = -1  # dim NorMuon averages over, from the global shape
    stack_index: int = -1  # -1: a matrix sharded across ranks (spans_ranks), not in a stack
    bucket_index: int = -1
    sharding: ShardLayout | None = None  # DTensor params
    # The parameter's position in the param groups (all params counted): a stable id, the same on
    # every rank and in every chunk, that keys the low-memory state's stochastic rounding.
    key: int = 0
    # The low-memory ops' ``draws`` entry of the local matrix view (_draws_of), made with the plan.
    draws: tuple[int, ...] = ()
    gtp: GTPLayout | None = None  # Megatron-LM's GTP row sharding (on top of tp)

    @property
    def spans_ranks(self) -> bool:
        """A matrix sharded across ranks: orthogonalized whole by ``multirank.sharded`` (an owner or
        every rank after a gather), not in a stack of local matrices."""
        return self.stack_index < 0

    @property
    def batch(self) -> int:
        """Matrices in the local view (its leading dim in nd_mode "batch", else 1)."""
        return self.local_shape[0] if len(self.local_shape) == 3 else 1

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The local matrix view of the param, its grad or a state tensor shaped like it."""
        t = local(t)
        return t if t.shape == self.local_shape else t.view(self.local_shape)


@dataclass
class Stack:
    """Matrices orthogonalized by one Newton–Schulz call (a (k, m, n) fp32 batch)."""

    local_shape: tuple[int, int]
    global_shape: tuple[int, int]
    device: torch.device
    tp: TPLayout | None
    split: MatrixSplit | None
    config: OrthogonalizationConfig  # how its matrices are orthogonalized (their param groups')
    members: list[int] = field(default_factory=list)  # entry indices
    gtp: GTPLayout | None = None  # GTP row shards: gathered (and unpadded) around the tp mode's work
    # layer_sharded over a GTP x TP domain, or a TP-replicated matrix: one home per matrix (multirank.layer_homes)
    home: Any = None


@dataclass
class Bucket:
    """Parameters updated by one launch of each foreach op (one param group, dtype and device)."""

    group_index: int
    dtype: torch.dtype
    device: torch.device
    members: list[int] = field(default_factory=list)  # entry indices


@dataclass
class Plan:
    entries: list[ParamEntry]
    stacks: list[Stack]
    buckets: list[Bucket]
    group_sizes: tuple[int, ...]  # len(group["params"]) per group when built: detects edits
    index: dict[int, int]  # id(param) -> entry index
    sharded: list[int] = field(default_factory=list)  # entries whose matrices span ranks
    # (group index, param index) of params that are not matrices under their nd_mode: no entry;
    # the optimizer refuses them at step(), where Emerging-Optimizers refuses them
    rejected: list[tuple[int, int]] = field(default_factory=list)
    params: tuple[torch.Tensor, ...] = ()  # every param of the groups, in order (detects edits)
    configs: tuple[OrthogonalizationConfig, ...] = ()  # each param group's settings when built
    # entry indices stepped together, in step order (stacks' members, then sharded matrices);
    # set by the optimizer from its workspace budget (chunk_entries)
    chunks: tuple[tuple[int, ...], ...] = ()
    # where each chunk's Newton–Schulz inputs lie, per set of entries with a grad: step.layout's
    # LayoutCache (which imports this module, not the other way round)
    # (made by the first eager step: a step compiled by torch.compile may rebuild the plan, and
    # dynamo constructs it without the cache)
    layouts: Any = field(default=None, repr=False, compare=False)


def _check_gtp(gtp: GTPLayout, local_shape, sharding, config: OrthogonalizationConfig, where: str) -> None:
    """What a GTP row-sharded parameter (Megatron-LM's ``is_gtp_weight_remat``) can take."""
    if sharding is not None or len(local_shape) != 2:
        raise ValueError(f"{where}: GTP weight rematerialization (is_gtp_weight_remat) shards a plain 2-D weight; "
                         f"got a {'DTensor' if sharding is not None else f'{len(local_shape)}-D matrix view'}")
    if not 0 <= gtp.pad_rows < local_shape[0] * gtp.size:
        raise ValueError(f"{where}: pad_length must be in [0, {local_shape[0] * gtp.size}) for {gtp.size} GTP shards of "
                         f"{local_shape[0]} rows, got {gtp.pad_rows}")
    if config.moment2_method in ("normuon", "namo"):
        raise ValueError(f"{where}: moment2_method={config.moment2_method!r} keeps statistics of the whole matrix, "
                         "which are not reduced over the GTP group (is_gtp_weight_remat): use 'adamuon' or Muon")


# The workspace budget of a step when none is given (``workspace_mib="auto"``), by where the
# matrices are. On a GPU, batching mid-size matrices pays: fewer, fuller launches. The CPU
# Newton–Schulz op orthogonalizes every matrix above a few million multiply-adds one at a time
# whatever the batch, so there a chunk's size only sets how many inputs wait in its buffer: 64 MiB
# keeps small models in one chunk and measured no slower than 256 on the CPU (docs/step-memory.md).
DEFAULT_WORKSPACE_MIB = "auto"
AUTO_WORKSPACE_MIB_CPU = 64
AUTO_WORKSPACE_MIB_GPU = 256


def check_workspace_mib(value, where: str = "workspace_mib") -> float | str | None:
    """The budget in MiB (a positive number), ``"auto"`` (by device, :func:`workspace_budget_bytes`),
    or None for no bound (every matrix in one chunk)."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f'{where} must be a positive number of MiB, "auto" or None (no bound), got {value!r}')
    return value


def workspace_budget_bytes(workspace_mib: float | str | None, plan: "Plan") -> float | None:
    """The budget in bytes a plan is chunked with: ``"auto"`` is AUTO_WORKSPACE_MIB_CPU when every
    matrix is on the CPU, else AUTO_WORKSPACE_MIB_GPU."""
    if workspace_mib is None:
        return None
    if workspace_mib == "auto":
        on_cpu = bool(plan.buckets) and all(b.device.type == "cpu" for b in plan.buckets)
        workspace_mib = AUTO_WORKSPACE_MIB_CPU if on_cpu else AUTO_WORKSPACE_MIB_GPU
    return workspace_mib * 2**20


def entry_step_bytes(entry: ParamEntry) -> int:
    """The bytes of fp32 buffers one entry needs while its matrices are orthogonalized: its local
    Newton–Schulz input, then for each matrix at the size it is orthogonalized (the global matrix
    for tensor-parallel and sharded params) the output, two iterates and the two s×s products.
    An estimate of what the Newton–Schulz kernels take (the standard iteration's buffers; the Gram
    iteration's are no larger), used only to cut the step into chunks.

    A DTensor entry is sized by the largest shard any rank holds (``ShardLayout.largest_view``), not
    by this rank's: ranks with uneven shards must cut the same chunks, or they would pair the
    chunks' collectives wrongly (a hang on NCCL)."""
    view = entry.local_shape if entry.sharding is None else entry.sharding.largest_view
    rows, cols = view[-2:]
    batch = view[0] if len(view) == 3 else 1
    g_rows, g_cols = entry.global_shape
    side = min(g_rows, g_cols)
    return 4 * batch * (rows * cols + 3 * g_rows * g_cols + 2 * side * side)


def chunk_entries(plan: Plan, budget_bytes: float | None) -> tuple[tuple[int, ...], ...]:
    """Every entry of ``plan`` once, in step order (each stack's members, then the sharded matrices),
    in chunks whose :func:`entry_step_bytes` sum to at most ``budget_bytes``. An entry larger than
    the budget is a chunk of its own; None keeps everything in one chunk (one Newton–Schulz call per
    stack). Depends only on the plan, so every rank cuts alike.

    Each stack (and the sharded matrices) is cut into the fewest pieces that fit the budget, of
    sizes as even as the entries allow: every piece is one Newton–Schulz call, and on a GPU a call's
    host time and a small batch's idle multiprocessors both cost time (sixteen experts at a budget
    of nine become 8 + 8, not 9 + 7, and a stack is never split where it would fit whole). Pieces
    then fill chunks in step order, so small stacks share a chunk and its foreach launches."""
    groups = [list(stack.members) for stack in plan.stacks] + ([list(plan.sharded)] if plan.sharded else [])
    if budget_bytes is None:
        order = [i for group in groups for i in group]
        return (tuple(order),) if order else ()
    chunks: list[tuple[int, ...]] = []
    current: list[int] = []
    used = 0
    for group in groups:
        sizes = [entry_step_bytes(plan.entries[i]) for i in group]
        start = 0
        for length in _even_pieces(sizes, budget_bytes):
            piece, size = group[start : start + length], sum(sizes[start : start + length])
            start += length
            if current and used + size > budget_bytes:
                chunks.append(tuple(current))
                current, used = [], 0
            current += piece
            used += size
    if current:
        chunks.append(tuple(current))
    return tuple(chunks)


def _cut(sizes: list[int], capacity: float) -> list[int]:
    """Lengths of the greedy cut of ``sizes`` into runs summing to at most ``capacity`` (an entry
    larger than it: a run of its own)."""
    lengths: list[int] = []
    used = 0
    for size in sizes:
        if lengths and used + size <= capacity:
            lengths[-1] += 1
            used += size
        else:
            lengths.append(1)
            used = size
    return lengths


def _even_pieces(sizes: list[int], budget_bytes: float) -> list[int]:
    """Lengths of the fewest runs of ``sizes`` that fit ``budget_bytes``, the largest sum of a run
    within the budget made as small as possible (an entry over the budget is a run of its own
    whatever the cut): the greedy cut at the smallest capacity that needs no more runs than the
    greedy cut at the budget (the number of runs only falls as the capacity grows)."""
    fewest = _cut(sizes, budget_bytes)
    if len(fewest) <= 1 or len(fewest) == len(sizes):
        return fewest
    low, high = 1, int(budget_bytes)  # high is known to do
    while low < high:
        mid = (low + high) // 2
        if len(_cut(sizes, mid)) <= len(fewest):
            high = mid
        else:
            low = mid + 1
    return _cut(sizes, high)


def _draws_of(entry: ParamEntry) -> tuple[int, int, int, int, int]:
    """The low-memory ops' ``draws`` entry of an entry's local matrix view: its elements draw at
    their index in the whole matrix view (the same bits sharded, chunked or whole). A DTensor whose
    local rows are not one box of the matrix (strided shards) draws by its local index."""
    s = entry.sharding
    if s is None or s.local_box is None:
        return draw_layout(entry.key, entry.local_shape, entry.local_shape)
    return draw_layout(entry.key, entry.local_shape, s.view_shape, s.local_box[0])


def _split_basis(local_shape, global_shape, spans: bool, tp: TPLayout | None, gtp: GTPLayout | None):
    """The shape of the matrix a parameter's split is applied to (see build_plan)."""
    if spans or (tp is not None and tp.mode in ("duplicated", "layer_sharded")):
        return global_shape
    if gtp is not None:  # the tensor-parallel local matrix: GTP's real rows (blockwise: this shard's)
        return (*local_shape[:-2], gtp.real_rows(local_shape[-2]), local_shape[-1])
    return local_shape


def build_plan(param_groups, config: OrthogonalizationConfig, layout_fn, qkv_fn, nd_mode: str = "error",
               sharded_mode: str = "owner", group_configs=None, gtp_fn=None, replica_work: str = "repeat",
               uneven: list | None = None, home_fn=None) -> Plan:
    """Groups every parameter (with or without a grad) into stacks and buckets.

    ``group_configs[gi]`` is how param group gi is orthogonalized (None: ``config`` for every
    group); matrices of groups with different settings never share a stack.

    layout_fn(p) -> TPLayout | None gives the tensor-parallel layout, gtp_fn(p) -> GTPLayout | None
    Megatron-LM's GTP row sharding; qkv_fn(p) -> split sizes or None says whether p is a fused QKV
    projection. nd_mode is the default of groups without one.
    DTensor params whose matrices span ranks are listed in ``sharded`` instead of a stack; params
    that are not real floating-point matrices (:func:`not_a_matrix`) in ``rejected``, without an entry.
    ``uneven[k]``: the k-th param's shards where they are off DTensor's chunking rule (``uneven_splits``).
    home_fn(p) -> HomeDomain | None: the domain whose ranks share p's matrix in tp_mode "layer_sharded"
    where it spans more than the TP group's shards (GTP) or is replicated over TP (multirank.layer_homes).
    """
    entries: list[ParamEntry] = []
    stacks: list[Stack] = []
    buckets: list[Bucket] = []
    stack_of: dict[tuple, int] = {}
    bucket_of: dict[tuple, int] = {}
    sharded: list[int] = []
    rejected: list[tuple[int, int]] = []
    coordinates: dict = {}  # mesh coordinates of owner groups, shared by the params of one build
    adaptive = config.moment2_method is not None
    configs = tuple(group_configs) if group_configs is not None else (config,) * len(param_groups)
    key = -1
    for gi, group in enumerate(param_groups):
        group_config = configs[gi]
        for pi, p in enumerate(group["params"]):
            key += 1
            where = f"param_groups[{gi}]['params'][{pi}]"
            mode = group.get("nd_mode", nd_mode)
            # A complex param reaches the plan only where a front end accepts it (torch.optim.Muon's
            # does, and refuses it at step); the ops take real floating point only.
            if not_a_matrix(p, mode) or not p.is_floating_point():
                rejected.append((gi, pi))
                continue
            sharding = None
            if is_dtensor(p):
                sharding = describe(p, mode, sharded_mode, where, coordinates, replica_work,
                                    uneven[key] if uneven and key < len(uneven) else None)
                if sharding.uneven is not None and configs[gi].moment2_method in ("normuon", "namo"):
                    raise ValueError(
                        f"{where}: moment2_method={configs[gi].moment2_method!r} keeps its statistics as DTensors laid "
                        "out by DTensor's chunking rule, which this parameter's shards do not follow (Megatron-FSDP's "
                        "uneven shards): use Muon or moment2_method='adamuon'"
                    )
            local_shape = batched_matrix_shape(tuple(local(p).shape), mode)
            tp = layout_fn(p)
            gtp = None if gtp_fn is None else gtp_fn(p)
            global_shape = list(local_shape[-2:] if sharding is None else sharding.view_shape[-2:])
            if gtp is not None:
                _check_gtp(gtp, local_shape, sharding, config, where)
                global_shape[0] = gtp.real_rows(local_shape[0])  # the tensor-parallel local matrix's
            if tp is not None:
                global_shape[tp.partition_dim] *= tp.size
            global_shape = tuple(global_shape)
            spans = sharding is not None and sharding.kind != "local"  # orthogonalized across ranks
            if spans and tp is not None:
                raise ValueError(
                    f"{where}: a DTensor whose matrices span ranks ({sharding.kind} mode) cannot also take a "
                    f"tensor-parallel layout ({tp.mode}, partition_dim {tp.partition_dim}): pass Megatron's plain "
                    "tensor-parallel shards, or a DTensor sharded over the tensor-parallel ranks without tp_mode"
                )
            view = group_view_keys(group)
            if view.transposed and tp is not None:
                raise ValueError(
                    f"{where}: matrix_layout='in_out' (weights stored (in, out)) cannot take a tensor-parallel "
                    "layout: Megatron's tensor-parallel weights are stored (out, in)"
                )
            # (out, in): the matrix the Muon scale, the split and NorMuon's statistic are defined on.
            oriented = global_shape[::-1] if view.transposed else global_shape
            try:
                sizes = qkv_fn(p)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if view.split_shapes is not None:
                if sizes is not None and tuple(int(x) for x in sizes) != view.split_shapes:
                    raise ValueError(
                        f"{where}: param_groups[{gi}]['split_shapes'] = {list(view.split_shapes)} and the optimizer's "
                        f"own split of this parameter ({list(sizes)}: split_qkv / split_heads) disagree: set one"
                    )
                sizes = view.split_shapes
            # The split is checked on the matrix it is applied to: a shard's rows need not hold whole
            # query groups where the shards are gathered first (a sharded DTensor; tp_mode duplicated or
            # layer_sharded; GTP's rows, their padding left out).
            split = None if sizes is None else matrix_split(sizes, _split_basis(local_shape, global_shape, spans, tp, gtp),
                                                         global_shape, where, view.transposed)
            if split is not None and spans and adaptive and sharding.local_box is None:
                raise ValueError(
                    f"{where}: QKV split of an adaptive optimizer on a DTensor with placements "
                    f"{list(sharding.placements)}: its local rows are not one contiguous range of the projection, "
                    "so the per-part scales cannot be placed; use plain Shard / Replicate placements or split_qkv=False"
                )
            part_scales: tuple = ()
            if split is None:
                update_scale = group_config.scale(*oriented)
            else:
                update_scale = 1.0
                if adaptive:
                    offsets = [sum(split.sizes[:i]) for i in range(len(split.sizes))]
                    part_scales = tuple(
                        (off, s, group_config.scale(split.global_groups * s, oriented[1]))
                        for off, s in zip(offsets, split.sizes)
                    )
            # NorMuon keeps one statistic per row of the (out, in) matrix when out >= in, else per column.
            normuon_dim = -1 if oriented[0] >= oriented[1] else -2
            if view.transposed:
                normuon_dim = -3 - normuon_dim
            entry = ParamEntry(
                param=p,
                group_index=gi,
                local_shape=local_shape,
                global_shape=global_shape,
                tp=tp,
                split=split,
                update_scale=update_scale,
                part_scales=part_scales,
                normuon_dim=normuon_dim,
                sharding=sharding,
                key=key,
                gtp=gtp,
            )
            entry.draws = _draws_of(entry)
            ei = len(entries)
            entries.append(entry)
            bkey = (gi, p.dtype, p.device)
            if bkey not in bucket_of:
                bucket_of[bkey] = len(buckets)
                buckets.append(Bucket(gi, p.dtype, p.device))
            entry.bucket_index = bucket_of[bkey]
            buckets[entry.bucket_index].members.append(ei)
            if sharding is not None and sharding.kind != "local":
                sharded.append(ei)
                continue

            home = None if home_fn is None or len(local_shape) != 2 else home_fn(p)
            skey = (local_shape[-2:], p.device, None if tp is None else tp.key,
                    None if split is None else (split.sizes, split.columns), id(group_config),
                    None if gtp is None else gtp.key, None if home is None else home.key)
            if skey not in stack_of:
                stack_of[skey] = len(stacks)
                stacks.append(Stack(local_shape[-2:], global_shape, p.device, tp, split, group_config, gtp=gtp,
                                    home=home))
            entry.stack_index = stack_of[skey]
            stacks[entry.stack_index].members.append(ei)
    return Plan(
        entries=entries,
        stacks=stacks,
        buckets=buckets,
        group_sizes=tuple(len(g["params"]) for g in param_groups),
        index={id(e.param): i for i, e in enumerate(entries)},
        sharded=sharded,
        rejected=rejected,
        params=tuple(p for g in param_groups for p in g["params"]),
        configs=configs,
    )
