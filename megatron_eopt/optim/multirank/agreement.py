"""Every rank of a device mesh takes the same path: refusals and step plans agreed before any step.

A sharded step is a sequence of collectives (owner all-to-alls, gathers, statistics all-reduces)
that every rank of a mesh must enter in the same order. Two things could break that silently:

- a refusal seen by some ranks only (a shard that breaks DTensor's chunking rule is visible only
  to the rank that holds it): those ranks raise while the others enter the step's first
  collective and wait forever on NCCL (gloo aborts);
- plans that differ between ranks (chunks cut from rank-local sizes, parameters added on one rank).

So wherever the optimizer checks DTensor parameters (``add_param_group``, a plan build), the ranks
exchange, over every mesh the parameters live on, whether any of them refused and a digest of what
the plan makes them do; every rank then raises the same error, or none does. This costs one tiny
all-reduce per mesh dim (and, only on a refusal, one object gather per mesh dim) where parameters
are added or regrouped, never in a step that keeps its plan.

Meshes are reduced dim by dim (an all-reduce over each mesh dim's group in turn reduces over the
whole grid), so no process group spanning a mesh is needed: pipeline stages' meshes work as they are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from ... import _collectives as collectives
from ...step_stats import count_agreement
from .dtensor_layout import is_dtensor

# Exception types a refusal is re-raised as on the ranks that did not see it (others: ValueError).
_TYPES = {t.__name__: t for t in (ValueError, TypeError, RuntimeError)}


def meshes_of(params: Iterable[torch.Tensor]) -> list[Any]:
    """The distinct device meshes of the DTensors among ``params``, in order of first appearance."""
    out: list[Any] = []
    for p in params:
        if is_dtensor(p) and not any(p.device_mesh is m or p.device_mesh == m for m in out):
            out.append(p.device_mesh)
    return out


@dataclass(eq=False)
class GroupScope:
    """A process group the ranks agree over, as a one-dim mesh (Megatron's tensor-parallel and GTP
    groups, which are not DeviceMeshes)."""

    group: Any
    device_type: str
    ndim: int = 1

    def size(self, dim: int | None = None) -> int:
        return dist.get_world_size(self.group)

    def get_group(self, dim: int = 0) -> Any:
        return self.group


def step_meshes(plan) -> list[Any]:
    """What a step of ``plan`` communicates over: the meshes of its matrices sharded across ranks
    (orthogonalized on an owner or gathered; an expert batch sharded on dim 0 needs none), then the
    tensor-parallel and GTP groups of its stacks, the home domains' included (as :class:`GroupScope`),
    in plan order."""
    cached = getattr(plan, "_step_meshes", None)
    if cached is None:
        cached = meshes_of(plan.entries[i].param for i in plan.sharded)
        seen = set()
        for stack in plan.stacks:
            home = stack.home  # layer_sharded homes over GTP x TP, or of a TP-replicated matrix
            groups = [layout.group for layout in (stack.tp, stack.gtp) if layout is not None]
            if home is not None:
                groups += [g for g, size in ((home.tp_group, home.tp_size), (home.gtp_group, home.gtp_size))
                           if g is not None and size > 1]
            for group in groups:
                if id(group) not in seen:
                    seen.add(id(group))
                    cached.append(GroupScope(group, stack.device.type))
        plan._step_meshes = cached
    return cached


def _multi_rank(meshes) -> list[Any]:
    return [m for m in meshes if m.size() > 1]


def _device(mesh) -> torch.device:
    """Where the agreement's integers are reduced: on the host wherever every group of the mesh has a
    CPU backend (``init_process_group("cpu:gloo,cuda:nccl")``, gloo), so that reading the result back
    does not wait for the device's queued work (the backward's tail would finish before the step's
    first kernel is launched: a gap in the device's work every step); else on the mesh's device."""
    if mesh.device_type == "cpu" or all(_has_cpu_backend(mesh.get_group(d)) for d in range(mesh.ndim)
                                        if mesh.size(d) > 1):
        return torch.device("cpu")
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _has_cpu_backend(group) -> bool:
    """Whether ``group`` reduces host tensors (its backend config names one for ``cpu``: the same on
    every rank, so every rank reduces in the same place)."""
    return any(part.split(":")[0].strip() == "cpu" for part in str(dist.get_backend_config(group)).split(","))


def _max_over(meshes, values: list[int]) -> list[int]:
    """Elementwise max of ``values`` over every rank of every mesh (dim by dim)."""
    out = values
    for mesh in meshes:
        t = torch.tensor(out, dtype=torch.int64, device=_device(mesh))
        for d in range(mesh.ndim):
            if mesh.size(d) > 1:
                collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group(d))
                count_agreement(2 * (mesh.size(d) - 1) * t.numel() * t.element_size() // mesh.size(d))
        out = t.tolist()
    return out


def _union_over(meshes, items: list) -> list:
    """The union of every rank's ``items`` (picklable, hashable) over the meshes, sorted."""
    known = set(items)
    for mesh in meshes:
        for d in range(mesh.ndim):
            if mesh.size(d) > 1:
                group = mesh.get_group(d)
                gathered: list = [None] * dist.get_world_size(group)
                collectives.all_gather_object(gathered, sorted(known), group=group)
                for part in gathered:
                    known.update(part)
    return sorted(known)


def fields_bytes(fields: Sequence[tuple[str, str]]) -> bytes:
    """The agreement's fields as the bytes their digest is taken of: names and values joined with
    the ASCII unit and record separators (no field holds them; a few times faster than their repr,
    which a step with hundreds of parameters pays on the host every step)."""
    return "\x1e".join([f"{name}\x1f{value}" for name, value in fields]).encode()


def digest_value(digest: bytes) -> int:
    # 7 bytes: a non-negative value whose negation also fits int64 (min and max from one MAX reduction).
    return int.from_bytes(hashlib.blake2b(digest, digest_size=7).digest(), "little")


def agree(meshes: list[Any], error: BaseException | None, digest: bytes = b"", what: str = "optimizer",
          fields: Sequence[tuple[str, str]] = ()) -> None:
    """Raises on every rank of ``meshes`` if any rank passes an ``error``, different ``fields`` or a
    different ``digest``.

    A refusal is re-raised on every rank with the message of the lowest rank that refused and the
    ranks that did; the ranks' own tracebacks stay with the ranks that saw it. ``fields`` are
    ``(name, value)`` pairs (every option, param group value and parameter that changes a collective
    or a result; see ``OrthogonalizedOptimizer._agreement_fields``): where they differ, every rank
    raises a ValueError naming the first field that differs and each rank's value. Costs one
    all-reduce of five integers per mesh dim of size > 1, and an object gather only when something
    differs. Without meshes of more than one rank this only raises ``error`` (single process: the
    error as it is).
    """
    meshes = _multi_rank(meshes)
    if not meshes or torch.compiler.is_compiling():
        if error is not None:
            raise error
        return
    value = digest_value(digest)
    field_value = digest_value(fields_bytes(fields)) if fields else 0
    failed, high, neg_low, field_high, field_neg_low = _max_over(
        meshes, [int(error is not None), value, -value, field_value, -field_value])  # (AGREEMENT_BYTES)
    if failed:
        mine = [] if error is None else [(dist.get_rank(), type(error).__name__, str(error))]
        refusals = _union_over(meshes, mine)
        rank, type_name, message = refusals[0]
        ranks = sorted({r for r, _, _ in refusals})
        exc = _TYPES.get(type_name, ValueError)(f"{message} [refused on rank(s) {ranks}: {EVERY_RANK}]")
        raise exc from error
    if field_high != -field_neg_low:
        every = _union_over(meshes, [(dist.get_rank(), tuple(fields))])
        raise ValueError(f"{what}: {difference(every)}; every rank of a mesh must construct and step the optimizer "
                         f"alike, or their collectives would not pair [{EVERY_RANK}]")
    if high != -neg_low:
        raise ValueError(
            f"{what}: the ranks built different step plans for their DTensor parameters (shapes, placements, "
            "nd_mode, sharded_mode, workspace_mib or param groups differ between ranks); every rank of a mesh must "
            f"construct the optimizer alike, or their collectives would not pair [{EVERY_RANK}]"
        )


EVERY_RANK = "every rank raises this"
AGREEMENT_BYTES = 5 * 8  # what one agreement all-reduces: five int64 (the planner counts them)
_ABSENT = "(absent)"


def difference(every: list[tuple[int, tuple[tuple[str, str], ...]]]) -> str:
    """Says where the ranks' ``fields`` (``(rank, fields)`` per rank) first differ: the field's name
    and each value with the ranks that hold it."""
    longest = max(len(f) for _, f in every)
    for i in range(longest):
        at = {rank: (f[i] if i < len(f) else (None, _ABSENT)) for rank, f in every}
        if len(set(at.values())) == 1:
            continue
        names = [n for n, _ in at.values() if n is not None]
        name = names[0] if len(set(names)) == 1 else " / ".join(dict.fromkeys(names))
        by_value: dict[str, list[int]] = {}
        for rank, (n, v) in sorted(at.items()):
            shown = v if n is None or n == name else f"{n} = {v}"
            by_value.setdefault(shown, []).append(rank)
        values = "; ".join(f"{v} on rank(s) {ranks}" for v, ranks in by_value.items())
        return f"the ranks differ in {name}: {values}"
    return "the ranks differ"  # (equal fields, unequal digests: not reached)


def plan_digest(plan) -> bytes:
    """What a plan makes the ranks do together: for every DTensor entry, its chunk, kind, global view,
    placements, mesh shape, matrix dims and split; nothing rank-local (no local shard, no process
    group id), so equal plans give equal digests on every rank."""
    parts = []
    for ci, chunk in enumerate(plan.chunks):
        for i in chunk:
            e = plan.entries[i]
            s = e.sharding
            if s is None:
                continue
            parts.append((ci, i, e.group_index, s.kind, s.view_shape, s.largest_view, tuple(map(str, s.placements)),
                          tuple(s.mesh.mesh.shape), s.mesh_dims_for_matrix, e.global_shape,
                          None if e.split is None else (e.split.sizes, e.split.columns)))
        for i in chunk:  # tensor-parallel shards: their mode, layout and local shape (no group id; with
            e = plan.entries[i]  # GTP "blockwise" each rank's real rows, and so its matrix, are its own)
            if e.tp is not None or e.gtp is not None:
                tp = None if e.tp is None else (e.tp.size, e.tp.partition_dim, e.tp.mode, e.tp.ns_batch_size)
                gtp = None if e.gtp is None else (e.gtp.size, e.gtp.pad_rows, e.gtp.blockwise)
                parts.append((ci, i, e.group_index, "tp", tp, gtp, e.local_shape,
                              None if e.split is None else (e.split.sizes, e.split.columns)))
    return repr((len(plan.entries), parts)).encode()


def plan_fingerprint(plan) -> str:
    """A short digest of :func:`plan_digest` (kept with the plan while its chunks stay)."""
    cached = getattr(plan, "_fingerprint", None)
    if cached is None or cached[0] != plan.chunks:
        cached = (plan.chunks, hashlib.blake2b(plan_digest(plan), digest_size=8).hexdigest())
        plan._fingerprint = cached
    return cached[1]


class RankAgreement:
    """Mixin of the orthogonalizing optimizers: what the ranks of a mesh agree on
    (``_agreement_fields``), when (``rank_checks``; construction and ``add_param_group`` call
    :func:`agree` with the fields, a step ``_agree_step``). The optimizer provides ``_config``,
    ``param_groups``, ``orthogonalize`` and the options of ``_OPTION_NAMES``."""

    _rank_checks: str = "every_step"
    _rank_checks_in_force: str = "every_step"  # the value every rank last agreed on (_agree_step)

    @property
    def rank_checks(self) -> str:
        """When the ranks of a mesh agree on everything that changes a collective or a result (the
        options, every param group's values, each parameter's name, shape, dtype and placements, and
        which parameters have a grad): ``"every_step"`` (default) at construction, at
        ``add_param_group`` and before every step whose matrices span ranks (one all-reduce of five
        integers per mesh dim); ``"riding"``: the same checks, but a step that can (a one-dim FSDP2
        step in owner mode, eager) compares them in a header of its first exchange instead of an
        all-reduce of its own (``multirank.riding``); ``"construction"``: at construction and
        ``add_param_group`` only (a value written, or a grad missing, on some ranks later is not
        caught). Set it alike on every rank. See docs/sharded.md "Ranks that differ"."""
        return self._rank_checks

    @rank_checks.setter
    def rank_checks(self, value: str) -> None:
        if value not in RANK_CHECKS:
            raise ValueError(f"rank_checks must be one of {list(RANK_CHECKS)}, got {value!r}")
        self._rank_checks = value

    def _agreement_fields(self, active: list[bool] | None = None, plan=None) -> list[tuple[str, str]]:
        """Everything that changes a collective or a result, as ``(name, value)`` pairs the ranks of a
        mesh must hold alike: the class and its options, every param group's values, and each
        parameter's name (where the groups carry ``param_names``), shape, dtype and placements;
        with ``active`` (per plan entry) also which parameters have a gradient this step and its dtype."""
        fields = [("optimizer", type(self).__qualname__)]
        config = self._config
        for f in dataclasses.fields(config):
            if f.name not in _DERIVED_CONFIG_FIELDS:
                fields.append((_CONFIG_ARGUMENT_NAMES.get(f.name, f.name), repr(getattr(config, f.name))))
        for name in _OPTION_NAMES:
            fields.append((name, repr(getattr(self, name, None))))
        if getattr(self, "block_period", None) is not None:  # MuonBP's phase: which steps are full ones
            fields.append(("block_period steps taken", str(self._block_steps)))
        hook = type(getattr(self, "_weight_update_hook", None)).__qualname__
        fields.append(("weight_update_hook", "None" if hook in _NO_HOOK else hook))
        fields.append(("orthogonalize", type(self).orthogonalize.__qualname__))
        entry_of = _entry_of_params(plan) if active is not None and plan is not None else None
        described = _described_params(self.param_groups, plan)
        if [len(rows) for rows in described] != [len(g["params"]) for g in self.param_groups]:
            described = _described_params(self.param_groups, None)  # (a plan older than the groups)
        for gi, group in enumerate(self.param_groups):
            where = f"param_groups[{gi}]"
            for key in sorted(k for k in group if k not in ("params", "param_names")):
                fields.append((f"{where}[{key!r}]", _value_repr(group[key])))
            for p, (name, shape, placed) in zip(group["params"], described[gi]):
                value = f"{shape} {_dtype_name(p.dtype)}{placed}"
                i = None if entry_of is None else entry_of.get(id(p))
                if i is not None and active[i] is not None:  # (None: an entry whose grad is not reported)
                    g = p.grad if active[i] else None
                    value += ", no grad" if g is None else f", grad {_dtype_name(g.dtype)}"
                fields.append((name, value))
        return fields

    def _agree_step(self, plan, active: list[bool | None] | None, error: Exception | None,
                    chunk: int | None = None) -> bool:
        """Raises ``error``, the same on every rank of the meshes this step communicates over (a
        matrix sharded across ranks), when any rank refused the step or holds different
        ``_agreement_fields`` (grads included): one all-reduce of five integers per mesh dim, before
        anything changes, so a rank never enters a collective the others do not. Not in a compiled
        step or a CUDA graph capture (no host values there), nor with ``rank_checks="construction"``
        in force: the value every rank last agreed on, not this rank's own (a rank that alone writes
        another is then told at the step, with the others). ``chunk``: the chunk about to start
        (``overlap_backward`` agrees before each chunk whose work communicates, with the grads of its
        members, and once more when step() finishes). Returns whether the ranks compared their fields
        (False: skipped, as above)."""
        block_step = getattr(self, "block_period", None) is not None and self._block_step_now()
        if (torch.compiler.is_compiling() or self._rank_checks_in_force == "construction" or not step_meshes(plan)
                or capturing_cuda_graph(plan) or block_step):  # (MuonBP's block steps communicate nothing)
            if not torch.compiler.is_compiling():
                self._rank_checks_in_force = self.rank_checks  # (leaving "construction": alike on every rank)
            if error is not None:
                raise error
            return False
        meshes = step_meshes(plan)
        fields = self._agreement_fields(active, plan)
        fields.append(("step plan", plan_fingerprint(plan)))
        if chunk is not None:
            fields.append(("chunk started", "step() finishing" if chunk < 0 else str(chunk)))
        agree(meshes, error, what=type(self).__name__, fields=fields)
        self._rank_checks_in_force = self.rank_checks
        return True


RANK_CHECKS = ("every_step", "riding", "construction")
# The configuration's fields named by the constructor argument that sets them, and those derived
# from others (the coefficient set's expansion), left out of the rank agreement's fields.
_CONFIG_ARGUMENT_NAMES = {"precision": "fp32_matmul_prec", "ns_eps": "eps"}
_DERIVED_CONFIG_FIELDS = frozenset({"coefficients", "table", "repeat_last"})
# The options outside the configuration that change a step's collectives or results.
_OPTION_NAMES = ("nd_mode", "sharded_mode", "replica_work", "overlap_backward", "block_period", "block_lr_scale",
                 "state_dtype", "state_block_size", "workspace_mib", "rank_checks")


def _described_params(param_groups, plan) -> list[list[tuple[str, str, str]]]:
    """Per group, per parameter: its field's name, its name (where the group carries
    ``param_names``) and shape, and its placements (DTensor), as the rank agreement compares them (the
    dtype is read at each call). Kept with the plan, which is rebuilt whenever the groups' parameters
    change."""
    cached = None if plan is None else getattr(plan, "_described_params", None)
    if cached is not None:
        return cached
    out = []
    for gi, group in enumerate(param_groups):
        names = group.get("param_names")
        rows = []
        for pi, p in enumerate(group["params"]):
            shape = str(tuple(p.shape))
            if names is not None and pi < len(names):
                shape = f"{names[pi]!r} {shape}"
            placed = f" {list(p.placements)} on mesh {tuple(p.device_mesh.mesh.shape)}" if is_dtensor(p) else ""
            rows.append((f"param_groups[{gi}]['params'][{pi}]", shape, placed))
        out.append(rows)
    if plan is not None:  # (the current plan: _agree_step's)
        plan._described_params = out
    return out


def _entry_of_params(plan) -> dict[int, int]:
    """Each parameter's plan entry (by ``id``), kept with the plan."""
    cached = getattr(plan, "_entry_of_params", None)
    if cached is None:
        cached = plan._entry_of_params = {id(e.param): i for i, e in enumerate(plan.entries)}
    return cached


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _value_repr(value) -> str:
    """A param group value as the rank agreement compares it: a tensor by its value (lr tensors
    written by a scheduler), anything else by its repr."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return repr(float(value))
        return f"tensor of shape {tuple(value.shape)}"
    return _ADDRESS.sub("", repr(value))  # (a function's repr holds its address: another on every rank)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_NO_HOOK = ("NoneType", "NoOpWeightUpdateHook")  # no weight-update hook, either way


def capturing_cuda_graph(plan) -> bool:
    """A CUDA graph capture is under way on a device of ``plan`` (no host values can be read: the
    agreement is skipped, and a step refuses a host learning rate)."""
    return any(b.device.type == "cuda" for b in plan.buckets) and torch.cuda.is_current_stream_capturing()
