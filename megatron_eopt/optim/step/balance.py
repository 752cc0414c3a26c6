"""Which rank orthogonalizes which matrix, decided from the plan: each chunk's starting loads.

Owner mode (``multirank.sharded``) gives every matrix sharded across ranks one owner, and tensor
parallel's ``layer_sharded`` mode every matrix one home (over the TP group, or over GTP x TP:
``multirank.layer_homes``), the least loaded by Newton–Schulz FLOPs.
A step in several chunks balances over all of them: a chunk starts from the loads the chunks before
it leave. Those loads are computed here, once per plan (and chunking), as if every chunk ran in plan
order with every member, so a chunk's owners depend on the plan and the chunk's own members only,
never on which chunk ran first: the step overlapped with backward (``step.overlap``), whose chunks
start in the order their gradients arrive, picks the owners the plain step picks, on every rank.
"""

from __future__ import annotations

from ..multirank.layer_homes import assign_homes
from ..multirank.sharded import charge_owner_loads
from ..multirank.tp_modes import layer_sharded_homes
from .grouping import Plan


def chunk_start_loads(plan: Plan, chunks: tuple, cache: bool = True) -> tuple[dict, ...] | None:
    """Per chunk of ``chunks``, the loads its balancing starts from (``{route or TP group key: FLOPs
    per member}``; the step hands each chunk a copy); None when nothing in the plan is balanced.
    Kept with the plan while its chunks stay (``cache``: False inside a compiled step)."""
    cached = getattr(plan, "_start_loads", None)
    if cached is not None and cached[0] is chunks:
        return cached[1]
    balanced = bool(plan.sharded) or any(s.home is not None or (s.tp is not None and s.tp.mode == "layer_sharded")
                                         for s in plan.stacks)
    starts = None
    if balanced:
        loads: dict = {}
        out = []
        for chunk in chunks:
            out.append({key: list(load) for key, load in loads.items()})
            _charge(plan, chunk, loads)
        starts = tuple(out)
    if cache:
        plan._start_loads = (chunks, starts)
    return starts


def _charge(plan: Plan, chunk, loads: dict) -> None:
    """What one chunk with every member adds to ``loads``, in the order the step's Newton–Schulz phase
    balances it (``FusedStep._orthogonalize_phase``): the sharded matrices per param group settings,
    then the stacks in order of their first member."""
    entries = plan.entries
    by_config: dict[int, list[int]] = {}
    by_stack: dict[int, list[int]] = {}
    for i in chunk:
        e = entries[i]
        if e.spans_ranks:
            by_config.setdefault(id(plan.configs[e.group_index]), []).append(i)
        else:
            by_stack.setdefault(e.stack_index, []).append(i)
    for members in by_config.values():
        charge_owner_loads([entries[i].sharding for i in members], loads)
    for si, members in by_stack.items():
        stack = plan.stacks[si]
        tp, home = stack.tp, stack.home
        if home is not None:  # (before tp: FusedStep._orthogonalize takes a home first)
            assign_homes(sum(entries[i].batch for i in members), *stack.local_shape, home,
                         loads.setdefault(home.key, [0.0] * home.size))
        elif tp is not None and tp.mode == "layer_sharded":
            layer_sharded_homes(sum(entries[i].batch for i in members), stack.global_shape, tp,
                                loads.setdefault(tp.key, [0.0] * tp.size))
