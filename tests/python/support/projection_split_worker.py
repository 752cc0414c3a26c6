"""One rank of the fused-projection split tests of the tensor-parallel classes (spawned by
test_optim_projection_splits.py, gloo on CPU).

Every rank builds the same logical matrices (a gated FC1's gate and up, a fused QKV's heads, an MLA
up-projection's parts), lays them out as Megatron-LM does on its tensor-parallel rank (a gated FC1's
``[gate_r; up_r]``, or blocks of ``glu_interleave_size`` rows; GTP shards with padding rows), steps
TensorParallelMuon / TensorParallelAdaptiveMuon on its shards in every tp_mode, and compares with the
package's single-process optimizer stepping the logical matrices split by hand (each its own
parameter): the gathered ones, or in blockwise mode this rank's, as Megatron-LM's blockwise mode has
them (a gated FC1's tensor-parallel local gate and up; heads whole, or gathered where a rank's rows
cut one).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from megatron_eopt.optim import TensorParallelAdaptiveMuon, TensorParallelMuon  # noqa: E402
from dist_harness import gloo_world  # noqa: E402
from reference import TOLERANCE, rel_err  # noqa: E402
from worker_exit import exits_without_teardown  # noqa: E402

TOL = 1e-6  # fp32 at "highest": the same matrices orthogonalized by the same op, sharded or by hand
STEPS = 2
HP = dict(lr=0.02, momentum=0.9, weight_decay=0.1, fp32_matmul_prec="highest")
MODES = ("duplicated", "distributed", "layer_sharded", "blockwise", "auto")
# (class, extra arguments): Muon and AdaMuon (elementwise) against the parts stepped by hand
BY_HAND = [(TensorParallelMuon, {}), (TensorParallelAdaptiveMuon, dict(moment2_method="adamuon"))]


def _run(cls, params, grads, kwargs):
    opt = cls(params, **kwargs)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return opt


def _tolerance(tp_mode, extra):
    """TOL; distributed mode runs another iteration (Gram matrices all-reduced, in plain PyTorch), equal
    to rounding (reference.TOLERANCE), which AdaMuon's elementwise division magnifies where an entry of
    the update is near zero (as test_optim_tensor_parallel has it)."""
    if tp_mode not in ("distributed", "auto"):  # auto: duplicated or distributed, per weight
        return TOL
    return TOLERANCE["high" if extra.get("moment2_method") == "adamuon" else "highest"]


def _check(got, start, expected, what, tol=TOL):
    err = rel_err(got - start, expected - start)
    assert err <= tol, f"{what}: rel err {err:.2e} (tolerance {tol:.0e})"


# ------------------------------------------------------------------ gated FC1
def glu_rows(gate, up, rank, size, interleave=None):
    """Megatron-LM's tensor-parallel local rows of a gated FC1 on ``rank`` of ``size``: [gate_r; up_r],
    or blocks [g, u, g, u, ...] of ``interleave`` rows."""
    rows = gate.shape[0] // size
    g, u = gate[rank * rows:(rank + 1) * rows], up[rank * rows:(rank + 1) * rows]
    if interleave is None:
        return torch.cat([g, u])
    blocks = []
    for start in range(0, rows, interleave):
        blocks += [g[start:start + interleave], u[start:start + interleave]]
    return torch.cat(blocks)


def gtp_shard(t, rank, size, pad):
    """This rank's GTP row shard of ``t`` padded by ``pad`` zero rows."""
    return torch.cat([t, t.new_zeros(pad, t.shape[1])]).chunk(size)[rank].clone()


# (I, H) of each gated FC1: gate and up (I, H), tall and wide
GLU_SHAPES = [(8, 6), (8, 12)]


def check_glu(tp_group, tp_mode, cls, extra, seed, interleave=None, gtp_group=None, pad=0, fused_reference=False):
    """Gated FC1 weights tagged ``is_glu`` (TP-local [gate_r; up_r], GTP shards with ``pad`` padding
    rows) against gate and up stepped by hand; ``fused_reference``: against the single-process class
    on the whole [gate; up] with split_glu (NorMuon / NAMO, whose statistics span the fused matrix)."""
    tp = (dist.get_rank(tp_group), dist.get_world_size(tp_group))
    gtp = (0, 1) if gtp_group is None else (dist.get_rank(gtp_group), dist.get_world_size(gtp_group))
    gen = torch.Generator().manual_seed(seed)
    gates = [torch.randn(shape, generator=gen) * 0.1 for shape in GLU_SHAPES]
    ups = [torch.randn(shape, generator=gen) * 0.1 for shape in GLU_SHAPES]
    grads = [[(torch.randn(s, generator=gen), torch.randn(s, generator=gen)) for s in GLU_SHAPES] for _ in range(STEPS)]

    def local(gate, up):
        return gtp_shard(glu_rows(gate, up, *tp, interleave), *gtp, pad)

    params = []
    for gate, up in zip(gates, ups):
        p = torch.nn.Parameter(local(gate, up))
        p.partition_dim, p.is_glu = 0, True
        if interleave is not None:
            p.glu_interleave_size = interleave
        if gtp_group is not None:  # as PR #6688's factory tags it
            p.is_gtp_weight_remat, p.pad_length, p.gtp_remat_size = True, pad, gtp[1]
        params.append(p)
    start = [p.detach().clone() for p in params]
    pg = SimpleNamespace(tp=tp_group, expt_tp=tp_group, gtp_remat=gtp_group, expt_gtp_remat=gtp_group)
    kwargs = dict(HP, **extra)
    _run(cls, params, [[local(g, u) for g, u in step] for step in grads],
         dict(kwargs, pg_collection=pg, tp_mode=tp_mode, split_glu=True))

    # blockwise: the tensor-parallel local gate and up (GTP's shards gathered), as Megatron-LM's PR #6688
    piece = (lambda t: t.chunk(tp[1])[tp[0]]) if tp_mode == "blockwise" else (lambda t: t)
    if fused_reference:
        ref = [torch.nn.Parameter(torch.cat([piece(g), piece(u)])) for g, u in zip(gates, ups)]
        for r in ref:
            r.is_glu = True
        _run(cls, ref, [[torch.cat([piece(g), piece(u)]) for g, u in step] for step in grads],
             dict(kwargs, split_glu=True))
        halves = [(r.detach()[: r.shape[0] // 2], r.detach()[r.shape[0] // 2:]) for r in ref]
    else:
        ref = [torch.nn.Parameter(piece(t).clone()) for pair in zip(gates, ups) for t in pair]
        _run(cls, ref, [[piece(t) for pair in step for t in pair] for step in grads], kwargs)
        halves = [(ref[2 * i].detach(), ref[2 * i + 1].detach()) for i in range(len(GLU_SHAPES))]
    for i, (p, s, (g, u)) in enumerate(zip(params, start, halves)):
        if tp_mode == "blockwise":  # back to the full layout, where only this rank's rows matter
            g = torch.cat([g] * tp[1])
            u = torch.cat([u] * tp[1])
        what = (f"GLU {tp_mode} {cls.__name__} {extra} {GLU_SHAPES[i]} interleave {interleave} TP {tp} GTP {gtp} "
                f"pad {pad}")
        _check(p.detach(), s, local(g, u), what, _tolerance(tp_mode, extra))


# ------------------------------------------------------------------ QKV, per head, MLA
def parts_of(full, sizes):
    """The logical matrices of ``full`` under the split rule: rows viewed as (groups, sum(sizes)),
    part i every group's rows of size i, in order."""
    total = sum(sizes)
    view = full.view(full.shape[0] // total, total, full.shape[1])
    return [p.reshape(-1, full.shape[1]) for p in view.split(list(sizes), dim=1)]


def from_parts(parts, sizes):
    """The inverse of :func:`parts_of`."""
    groups = parts[0].shape[0] // sizes[0]
    return torch.cat([p.view(groups, s, -1) for p, s in zip(parts, sizes)], dim=1).reshape(-1, parts[0].shape[1])


# name: (rows, cols, split_qkv_per_head, what the optimizer is given, the split of the reference)
#  - "groups": 2 query groups of [q, k, v] = [4, 2, 2]: TP 4 cuts every group (TP > query groups)
#  - "heads": 8 heads of 2 rows, per head, from the optimizer's qkv_split_shapes: whole on every rank
#  - "uneven_heads": heads [3, 3, 2] x 2 tagged qkv_split_shapes_global: whole at TP 2, cut at TP 4
#  - "mla_kv_up": an MLA kv up-projection of 4 heads tagged qkv_layout, (qk_head_dim, v_head_dim) = (3, 2)
#    per head: the K and the V of all heads (the groups rule), and per head
QKV_CASES = {
    "groups": (16, 6, False, dict(qkv_split_shapes=[4, 2, 2]), [4, 2, 2]),
    "heads": (16, 6, True, dict(qkv_split_shapes=[2] * 8), [16]),
    "uneven_heads": (16, 5, True, dict(qkv_split_shapes_global=[3, 3, 2] * 2), [16]),
    "mla_kv_up": (20, 7, False, dict(qkv_layout=(4, (3, 2), (3, 2))), [3, 2]),
    "mla_kv_up_per_head": (20, 7, True, dict(qkv_layout=(4, (3, 2), (3, 2))), [20]),
}


def _heads(case):
    rows, _, per_head, given, _ = QKV_CASES[case]
    if "qkv_split_shapes_global" in given:
        return given["qkv_split_shapes_global"]
    if "qkv_layout" in given:
        groups, _, per = given["qkv_layout"]
        return list(per) * groups
    return given["qkv_split_shapes"]


def _reference_parts(case, full):
    """The logical matrices of ``full`` (a whole fused matrix) for case ``case``."""
    _, _, per_head, _, split = QKV_CASES[case]
    if per_head:
        return list(full.split(_heads(case)))
    return parts_of(full, split)


def _from_reference_parts(case, parts):
    _, _, per_head, _, split = QKV_CASES[case]
    return torch.cat(parts) if per_head else from_parts(parts, split)


def check_qkv(tp_group, tp_mode, cls, extra, seed, case, gtp_group=None, pad=0):
    """A fused QKV / MLA up-projection ``case`` (GTP shards of its tensor-parallel rows with ``pad``
    padding rows) against its parts stepped by hand."""
    rank, size = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    gtp = (0, 1) if gtp_group is None else (dist.get_rank(gtp_group), dist.get_world_size(gtp_group))
    rows, cols, per_head, given, split = QKV_CASES[case]
    gen = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, cols, generator=gen) * 0.1
    grads = [torch.randn(rows, cols, generator=gen) for _ in range(STEPS)]
    tp_rows = lambda t: t.chunk(size)[rank].clone()  # noqa: E731
    shard = lambda t: gtp_shard(tp_rows(t), *gtp, pad)  # noqa: E731
    p = torch.nn.Parameter(shard(full))
    p.partition_dim, p.is_qkv = 0, True
    if gtp_group is not None:
        p.is_gtp_weight_remat, p.pad_length = True, pad
    kwargs = dict(HP, **extra)
    opt_kwargs = dict(kwargs, split_qkv=True, is_qkv_fn=lambda t: getattr(t, "is_qkv", False),
                      split_qkv_per_head=per_head, tp_mode=tp_mode,
                      pg_collection=SimpleNamespace(tp=tp_group, expt_tp=tp_group, gtp_remat=gtp_group,
                                                    expt_gtp_remat=gtp_group))
    if "qkv_split_shapes" in given:
        opt_kwargs["qkv_split_shapes"] = given["qkv_split_shapes"]
    if "qkv_split_shapes_global" in given:
        p.qkv_split_shapes_global = given["qkv_split_shapes_global"]
    if "qkv_layout" in given:
        groups, projection, per = given["qkv_layout"]
        p.qkv_layout = SimpleNamespace(num_groups=groups, projection_split_shapes=projection, per_head_split_shapes=per)
    start = p.detach().clone()
    opt = _run(cls, [p], [[shard(g)] for g in grads], opt_kwargs)

    # Megatron-LM's blockwise mode splits the local rows where they hold whole parts (the groups rule
    # on whole groups), and gathers the matrix where a rank's rows cut a group or a head.
    local_rows = rows // size
    whole_parts = (per_head and all(k * local_rows in _boundaries(_heads(case)) for k in range(size + 1))) or (
        not per_head and local_rows % sum(split) == 0)
    if tp_mode == "blockwise" and whole_parts and not per_head:  # the rank's tensor-parallel rows
        ref = [torch.nn.Parameter(t.clone()) for t in parts_of(tp_rows(full), split)]
        _run(cls, ref, [parts_of(tp_rows(g), split) for g in grads], kwargs)
        expected = gtp_shard(from_parts([r.detach() for r in ref], split), *gtp, pad)
    else:
        ref = [torch.nn.Parameter(t.clone()) for t in _reference_parts(case, full)]
        _run(cls, ref, [_reference_parts(case, g) for g in grads], kwargs)
        expected = shard(_from_reference_parts(case, [r.detach() for r in ref]))
    _check(p.detach(), start, expected, f"QKV {case} {tp_mode} {cls.__name__} {extra} TP {size} GTP {gtp} pad {pad}",
           _tolerance(tp_mode, extra))
    mode = opt.tp_modes()[0]
    if gtp_group is not None:
        pass  # heads under GTP: split on the gathered matrix
    elif per_head and whole_parts:
        assert mode == "blockwise", (case, tp_mode, mode)  # each rank its own heads: no communication
    elif not whole_parts:
        assert mode in ("duplicated", "layer_sharded"), (case, tp_mode, mode)  # cut parts: gathered


def _boundaries(sizes):
    out, at = {0}, 0
    for s in sizes:
        at += s
        out.add(at)
    return out


# ------------------------------------------------------------------ DTensor (FSDP2)
def check_dtensor_glu(seed, placement):
    """A gated FC1 [gate; up] as a DTensor sharded over the ranks (Megatron-LM's Torch-FSDP2: no tensor
    parallelism in the optimizer) against gate and up stepped by hand."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(6, 8, generator=gen) * 0.1 for _ in range(2))
    grads = [(torch.randn(6, 8, generator=gen), torch.randn(6, 8, generator=gen)) for _ in range(STEPS)]
    p = torch.nn.Parameter(distribute_tensor(torch.cat([gate, up]), mesh, [placement], src_data_rank=None))
    p.is_glu = True
    opt = TensorParallelMuon([p], split_glu=True, **HP)
    for g, u in grads:
        p.grad = distribute_tensor(torch.cat([g, u]), mesh, [placement], src_data_rank=None)
        opt.step()
    ref = [torch.nn.Parameter(gate.clone()), torch.nn.Parameter(up.clone())]
    _run(TensorParallelMuon, ref, [list(pair) for pair in grads], HP)
    got = p.detach().full_tensor()
    _check(got, torch.cat([gate, up]), torch.cat([r.detach() for r in ref]), f"GLU DTensor {placement}")


@exits_without_teardown
def worker(rank, world_size, init_file, seed):
    """2 ranks: TP 2, every mode and split; DTensor shards. 4 ranks: TP 4, and TP 2 x GTP 2 with padding."""
    with gloo_world(rank, world_size, init_file):
        if world_size == 2:
            tp_groups = [dist.group.WORLD]
        else:
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            gtp_pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
            tp_groups = [dist.group.WORLD]
        for group in tp_groups:
            for tp_mode in MODES:
                for cls, extra in BY_HAND:
                    check_glu(group, tp_mode, cls, extra, seed)
                    check_glu(group, tp_mode, cls, extra, seed, interleave=2)
                    for case in QKV_CASES:
                        check_qkv(group, tp_mode, cls, extra, seed, case)
                for method in ("normuon", "namo"):
                    check_glu(group, tp_mode, TensorParallelAdaptiveMuon, dict(moment2_method=method), seed,
                              fused_reference=True)
        if world_size == 2:
            from torch.distributed.tensor import Shard

            check_dtensor_glu(seed, Shard(0))
            check_dtensor_glu(seed, Shard(1))
            return
        for tp_mode in MODES:
            for cls, extra in BY_HAND:
                # TP 2 x GTP 2: the tensor-parallel local [gate_r; up_r] (8 or 4 rows) padded by 2 rows
                check_glu(pairs[rank // 2], tp_mode, cls, extra, seed, gtp_group=gtp_pairs[rank % 2], pad=2)
                check_glu(pairs[rank // 2], tp_mode, cls, extra, seed, interleave=2, gtp_group=gtp_pairs[rank % 2],
                          pad=2)
                for case in ("groups", "uneven_heads"):  # a GTP shard of 5 rows cuts a query group, heads
                    check_qkv(pairs[rank // 2], tp_mode, cls, extra, seed, case, gtp_group=gtp_pairs[rank % 2], pad=2)
        singles = [dist.new_group([r]) for r in range(world_size)]
        for tp_mode in ("duplicated", "blockwise"):  # GTP 4 alone (TP groups of one rank), no padding
            check_glu(singles[rank], tp_mode, TensorParallelMuon, {}, seed, gtp_group=dist.group.WORLD)
