"""Tensor-parallel pieces of the step (Megatron's tp_mode "duplicated", "distributed", "layer_sharded").

What runs where:
- duplicated: the local (k, m, n) batch of NS inputs is all-gathered along partition_dim (one
  all_gather per stack), the fused batched Newton–Schulz op runs on the global matrices on every
  rank, and each rank keeps its chunk.
- distributed: Newton–Schulz cannot call a collective from inside the fused op, so it runs in
  plain PyTorch on the local shards, batched per stack, with all-reduces of the norms and Gram
  matrices (:mod:`megatron_eopt.ops._distributed`, shared with ``newton_schulz(tp_group=...)``).
- layer_sharded: each matrix's shards go to one home rank of the group, which orthogonalizes it
  whole and sends the shards of the result back (the owner exchange of :mod:`.sharded`).
- AdaptiveMuon's NorMuon / NAMO statistics (row means, Frobenius norms) reduce over the whole
  matrix, so for sharded parameters they are computed here with all-reduces of the partial sums
  (one or two per bucket); AdaMuon is elementwise and uses the fused op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ... import _collectives as collectives
from ...ops._distributed import distributed_newton_schulz as _distributed_newton_schulz, gram_restarts
from .._config import OrthogonalizationConfig
from ..matrix_view import MatrixSplit, newton_schulz_in_batches
from .cost_model import AUTO_CANDIDATES, auto_tp_mode, auto_tp_mode_seconds
from .owner_exchange import ITEMS_PER_RANK, OwnerExchange, OwnerRoute, assign_owners, ns_flops


@dataclass(frozen=True)
class TPLayout:
    """How one parameter is sharded over a tensor-parallel group (Megatron's partition_dim)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    partition_dim: int  # 0: rows are sharded, 1: columns are sharded
    mode: str  # "duplicated" | "distributed" | "layer_sharded"
    ns_batch_size: int = 0  # layer_sharded: matrices per Newton–Schulz call on a home

    @property
    def key(self) -> tuple:
        return (id(self.group), self.partition_dim, self.mode, self.ns_batch_size)


@dataclass(frozen=True)
class GTPLayout:
    """How one parameter is sharded along its rows by Megatron-LM's GTP weight rematerialization
    (``is_gtp_weight_remat``): the rows of the tensor-parallel local matrix, padded by ``pad_rows``
    trailing zero rows to a multiple of the group's size, are split evenly over ``group``.
    ``blockwise``: tp_mode "blockwise" (each shard orthogonalized as it is, its own padding left out)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    pad_rows: int
    blockwise: bool

    @property
    def key(self) -> tuple:
        return (id(self.group), self.size, self.pad_rows, self.blockwise)

    def real_rows(self, local_rows: int) -> int:
        """Rows of the matrix without its padding: this shard's (blockwise) or the gathered matrix's."""
        if self.blockwise:
            from_end = self.size - 1 - self.rank
            return local_rows - min(local_rows, max(0, self.pad_rows - from_end * local_rows))
        return local_rows * self.size - self.pad_rows


def gtp_orthogonalize(x: torch.Tensor, gtp: GTPLayout, orthogonalize) -> list[torch.Tensor]:
    """Newton–Schulz of a stack of GTP row shards (k, m_local, n): the shards are all-gathered over
    the GTP group (blockwise: not), the padding rows left out, ``orthogonalize`` (the tensor-parallel
    mode's work on (k, rows, n), returning k results) run on the real rows, and this rank's rows of
    the results returned, zero where they are padding (Megatron-LM's
    ``scaled_orthogonalize_fn_with_gtp_remat``). The Muon scale is the real matrix's (rows less
    ``pad_length``) in every mode, as in Megatron-LM since #7236. tp_mode "layer_sharded" does not
    come here: its matrices get one home in the GTP x TP domain (:mod:`.layer_homes`)."""
    k, rows, cols = x.shape
    full = x if gtp.blockwise else gather_rows(x, gtp)
    real = gtp.real_rows(rows)
    if real == 0:  # all padding: NS(0) = 0
        return list(torch.zeros_like(x).unbind(0))
    outs = orthogonalize(full[:, :real].contiguous() if real < full.shape[1] else full)
    results = []
    for out in outs:
        if real < full.shape[1]:
            out = torch.cat([out, out.new_zeros(full.shape[1] - real, cols)])
        results.append(out if gtp.blockwise else out[gtp.rank * rows : (gtp.rank + 1) * rows])
    return results


def gather_rows(x: torch.Tensor, gtp: GTPLayout) -> torch.Tensor:
    """(k, m_local, n) row shards on each rank of the GTP group -> (k, m_local · size, n)."""
    shards = [torch.empty_like(x) for _ in range(gtp.size)]
    collectives.all_gather(shards, x.contiguous(), group=gtp.group)
    return torch.cat(shards, dim=1)


def gather_shards(x: torch.Tensor, tp: TPLayout) -> torch.Tensor:
    """(k, m_local, n_local) on each rank -> (k, m, n), shards concatenated along partition_dim."""
    shards = [torch.empty_like(x) for _ in range(tp.size)]
    collectives.all_gather(shards, x.contiguous(), group=tp.group)
    return torch.cat(shards, dim=1 + tp.partition_dim)


def local_chunk(x: torch.Tensor, tp: TPLayout) -> torch.Tensor:
    """This rank's chunk of a global (m, n) matrix or (k, m, n) batch (contiguous)."""
    return x.chunk(tp.size, dim=x.ndim - 2 + tp.partition_dim)[tp.rank].contiguous()


def _gram_restarts(config: OrthogonalizationConfig, m: int, n: int, transpose: bool, device_type: str):
    """The restart flags when the fused op would run the Gram iteration on this global matrix, else None."""
    return gram_restarts(config.table, config.num_ns_steps, config.repeat_last, m, n, transpose, config.precision,
                         config.algorithm, device_type)


def distributed_newton_schulz(
    x: torch.Tensor, tp: TPLayout, config: OrthogonalizationConfig, eps: float | None = None
) -> torch.Tensor:
    """Newton–Schulz of a batch of sharded matrices, equal to the unsharded result (docs/design.md §4.1, §4.9)."""
    return _distributed_newton_schulz(
        x, tp.group, tp.size, tp.partition_dim, coefficients=config.coefficients, table=config.table,
        steps=config.num_ns_steps, repeat_last=config.repeat_last, precision=config.precision,
        algorithm=config.algorithm, eps=config.ns_eps if eps is None else eps,
    )


def distributed_orthogonalize(
    x: torch.Tensor,
    tp: TPLayout,
    split: MatrixSplit | None,
    global_shape: tuple[int, int],
    config: OrthogonalizationConfig,
    scaled: bool,
) -> torch.Tensor:
    """tp_mode "distributed" for one stack; QKV parts are orthogonalized (and scaled) one by one."""
    if split is None:
        return distributed_newton_schulz(x, tp, config)
    k, rows, cols = x.shape
    groups = rows // split.total  # this rank's query groups (of the gathered GTP rows too)
    view = x.view(k, groups, split.total, cols)
    out = torch.empty_like(view)
    offset = 0
    for size in split.sizes:
        part = view[:, :, offset : offset + size, :].reshape(k, groups * size, cols)
        o = distributed_newton_schulz(part, tp, config)
        if scaled:
            o = o * config.scale(split.global_groups * size, global_shape[1])
        out[:, :, offset : offset + size, :] = o.view(k, groups, size, cols)
        offset += size
    return out.view(k, rows, cols)


def layer_sharded_homes(k: int, global_shape, tp: TPLayout, load: list[float]):
    """The exchange chunks and home ranks of a layer-sharded stack of ``k`` matrices of
    ``global_shape``, balanced from ``load`` (each rank's FLOPs so far; updated in place)."""
    per_home = max(ITEMS_PER_RANK, tp.ns_batch_size)
    return assign_owners([ns_flops(global_shape)] * k, tp.size, per_home * tp.size, load)


def layer_sharded_orthogonalize(
    x: torch.Tensor,
    tp: TPLayout,
    split: MatrixSplit | None,
    config: OrthogonalizationConfig,
    scaled: bool,
    load: list[float],
) -> list[torch.Tensor]:
    """tp_mode "layer_sharded" for one stack of k shards (k, m_local, n_local): each matrix gets a
    home rank in the group (the least loaded by Newton–Schulz FLOPs, ``load`` carried over the
    step's stacks), which receives every shard, orthogonalizes the whole matrix in batches of
    ``tp.ns_batch_size`` and sends each rank its shard of the result (the owner exchange of
    :mod:`.sharded`: one all-to-all each way per chunk, chunks pipelined). QKV parts as in
    duplicated mode. Returns this rank's k result shards."""
    k, rows, cols = x.shape
    d = tp.partition_dim
    global_shape = (rows * tp.size, cols) if d == 0 else (rows, cols * tp.size)
    chunks, homes = layer_sharded_homes(k, global_shape, tp, load)
    route = OwnerRoute(tp.group, tuple(range(tp.size)), tp.rank, ("tp", id(tp.group)))
    numel = rows * cols
    outs: list[torch.Tensor | None] = [None] * k

    def orthogonalize(owned, pieces):
        if not owned:
            return []
        full = torch.stack([torch.cat([piece.view(rows, cols) for piece in parts], dim=d) for parts in pieces])
        return newton_schulz_in_batches(config, full, tp.ns_batch_size, split, scaled)

    def deliver(i, piece):
        outs[i] = piece.view(rows, cols)

    OwnerExchange(
        route, chunks, homes,
        to_owner=lambda i, s: numel,
        send=lambda i: x[i],
        compute=orthogonalize,
        from_owner=lambda i, s: numel,
        back=lambda i, result, s: result.chunk(tp.size, dim=d)[s],
        deliver=deliver,
        like=x,
    ).run()
    return outs


def _all_reduce_many(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Sums a list of fp32 tensors over the group with one collective."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors])
    collectives.all_reduce(flat, group=group)
    return [chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def _keep_unless_inf(new: torch.Tensor, old: torch.Tensor, found_inf: torch.Tensor | None) -> torch.Tensor:
    """new, or old where GradScaler found an inf / NaN gradient (decided on the device, no sync)."""
    return new if found_inf is None else torch.where(found_inf != 0, old, new)


def _lerp_weight(beta2: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # float(1 - beta2) from the fp64 value, as the fused ops and the reference's Python float.
    return (1 - beta2).to(like.dtype)


def tp_normuon_normalize_(updates, moment2, entries, *, beta2, eps, found_inf=None) -> None:
    """NorMuon (docs/design.md §4.7) on shards of one TP group, statistics of the global matrices.

    beta2 and eps are 0-dim tensors; a non-zero found_inf leaves the state as it was.
    """
    group = entries[0].tp.group
    partial, reduced = [], []
    for u, e in zip(updates, entries):
        s = u.square().sum(dim=e.normuon_dim, keepdim=True)
        (reduced if _reduces_over_shards(e) else partial).append(s)
    sums = iter(_all_reduce_many(reduced, group))
    locals_ = iter(partial)
    norms = []
    scaled = []
    eps32 = eps.to(torch.float32)
    for u, v, e in zip(updates, moment2, entries):
        s = next(sums) if _reduces_over_shards(e) else next(locals_)
        mean = s / e.global_shape[e.normuon_dim]
        new_v = torch.lerp(v.float(), mean, _lerp_weight(beta2, mean))
        v.copy_(_keep_unless_inf(new_v, v, found_inf))
        step = u * new_v.clamp_min(eps32).rsqrt()
        norms.append(torch.stack([u.square().sum(), step.square().sum()]))
        scaled.append(step)
    norms = _all_reduce_many(norms, group)
    for u, step, n in zip(updates, scaled, norms):
        u.copy_(step * (n[0].sqrt() / n[1].sqrt().clamp_min(eps32)))


def _reduces_over_shards(e) -> bool:
    # dim -1 averages over columns (sharded when partition_dim is 1), dim -2 over rows.
    return (e.normuon_dim == -1) == (e.tp.partition_dim == 1)


def tp_namo_normalize_(updates, moment2, grads, ns_inputs, entries, *, beta2, eps, grad_scale=None,
                       found_inf=None) -> None:
    """NAMO (docs/design.md §4.7) on shards of one TP group: the two Frobenius norms are global.

    beta2 and eps are 0-dim tensors; gradients scaled by grad_scale (GradScaler) are unscaled in
    the norm, and a non-zero found_inf leaves the state as it was.
    """
    group = entries[0].tp.group
    sums = _all_reduce_many(
        [torch.stack([g.float().square().sum(), x.square().sum()]) for g, x in zip(grads, ns_inputs)], group
    )
    eps32 = eps.to(torch.float32)
    for u, v, s in zip(updates, moment2, sums):
        grad_sq = s[0] if grad_scale is None else s[0] / grad_scale.float().square()
        new_v = torch.lerp(v.float(), grad_sq.expand_as(v), _lerp_weight(beta2, grad_sq))
        v.copy_(_keep_unless_inf(new_v, v, found_inf))
        u.mul_(s[1].sqrt() / (new_v.sqrt() + eps32))


__all__ = [
    "AUTO_CANDIDATES",  # tp_mode "auto": the cost model's (multirank.cost_model), importable here as before
    "auto_tp_mode",
    "auto_tp_mode_seconds",
    "distributed_newton_schulz",
    "distributed_orthogonalize",
    "GTPLayout",
    "gather_rows",
    "gather_shards",
    "gtp_orthogonalize",
    "layer_sharded_orthogonalize",
    "local_chunk",
    "tp_namo_normalize_",
    "tp_normuon_normalize_",
]

