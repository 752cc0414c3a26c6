"""Tensor-parallel pieces of the step (Megatron's tp_mode "duplicated" and "distributed").

What runs where:
- duplicated: the local (k, m, n) batch of NS inputs is all-gathered along partition_dim (one
  all_gather per stack), the fused batched Newton–Schulz op runs on the global matrices on every
  rank, and each rank keeps its chunk.
- distributed: Newton–Schulz cannot call a collective from inside the fused op, so it runs here in
  plain PyTorch on the local shards, batched per stack: one all-reduce of the k squared Frobenius
  norms, then per iteration one all-reduce of the k Gram matrices (of the unsharded side, as in
  Megatron: partition_dim 0 iterates on the transpose). The Gram partials are summed in fp32
  (bf16 products accumulate in fp32, like the fused op's GEMMs) and rounded to the compute dtype
  once, after the sum. Where the fused op would take the Gram iteration for the global matrix
  (same choice and restarts, ns_algorithm.h), it runs here too: the s x s recursion needs no
  communication, so there is one Gram all-reduce per (re)start instead of one per iteration.
- AdaptiveMuon's NorMuon / NAMO statistics (row means, Frobenius norms) reduce over the whole
  matrix, so for sharded parameters they are computed here with all-reduces of the partial sums
  (one or two per bucket); AdaMuon is elementwise and uses the fused op.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import torch
import torch.distributed as dist

from .._library import ns_plan
from ._config import OrthogonalizationConfig
from ._plan import QKVSplit, TPLayout


def gather_shards(x: torch.Tensor, tp: TPLayout) -> torch.Tensor:
    """(k, m_local, n_local) on each rank -> (k, m, n), shards concatenated along partition_dim."""
    shards = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(shards, x.contiguous(), group=tp.group)
    return torch.cat(shards, dim=1 + tp.partition_dim)


def local_chunk(x: torch.Tensor, tp: TPLayout) -> torch.Tensor:
    """This rank's chunk of a global (m, n) matrix or (k, m, n) batch (contiguous)."""
    return x.chunk(tp.size, dim=x.ndim - 2 + tp.partition_dim)[tp.rank].contiguous()


@contextlib.contextmanager
def _matmul_precision(precision: str):
    # Only the plain-PyTorch distributed iteration needs this: "high" means TF32 GEMMs.
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "high" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


@functools.lru_cache(maxsize=256)
def _gram_restarts(config: OrthogonalizationConfig, m: int, n: int, transpose: bool, device_type: str):
    """The restart flags when the fused op would run the Gram iteration on this global matrix, else None."""
    use_gram, restarts = ns_plan(config.table, config.num_ns_steps, config.repeat_last, m, n, transpose, config.precision,
                                 config.algorithm, device_type)
    return restarts if use_gram else None


def _distributed_gram(X: torch.Tensor, tp: TPLayout, config: OrthogonalizationConfig, restarts) -> torch.Tensor:
    """The Gram iteration (docs/design.md §4.4) on local shards X (k, s, l_local) of the working matrices:
    R = sum over ranks of X X^T (one all-reduce per (re)start), then the s x s recursion, identical
    on every rank, and X Q-applied locally. R and Q stay fp32; X keeps the compute dtype (bf16 for
    "medium", rounded after each restart as in the fused op)."""
    compute = X.dtype

    def gram(W):
        Wf = W.float()
        R = torch.bmm(Wf, Wf.mT)
        dist.all_reduce(R, group=tp.group)
        return R

    R = gram(X)
    Q = None
    coefficients = config.coefficients
    for k, (a, b, c) in enumerate(coefficients):
        if k > 0 and restarts[k]:
            X = torch.bmm(Q.to(compute).float(), X.float()).to(compute)
            R = gram(X)
            Q = None
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(0, -2, -1).add_(a)
        if k + 1 < len(coefficients) and not restarts[k + 1]:
            R = torch.bmm(P, torch.bmm(R, P))
        Q = P if Q is None else torch.bmm(Q, P)
    return torch.bmm(Q.to(compute).float(), X.float())


def distributed_newton_schulz(
    x: torch.Tensor, tp: TPLayout, config: OrthogonalizationConfig, eps: float | None = None
) -> torch.Tensor:
    """Newton–Schulz of a batch of sharded matrices, equal to the unsharded result (docs/design.md §4.1, §4.9)."""
    transpose = tp.partition_dim == 0  # iterate so that the sharded side is the contracted one
    w = x.mT if transpose else x
    sq = w.square().sum(dim=(-2, -1))
    dist.all_reduce(sq, group=tp.group)
    norm = sq.sqrt().clamp_min(config.ns_eps if eps is None else eps)
    compute = torch.bfloat16 if config.precision == "medium" else torch.float32
    X = (w / norm[:, None, None]).to(compute)
    s, l_global = w.shape[-2], w.shape[-1] * tp.size
    m, n = (l_global, s) if transpose else (s, l_global)
    restarts = _gram_restarts(config, m, n, transpose, x.device.type)
    if restarts is not None:
        with _matmul_precision(config.precision):
            out = _distributed_gram(X, tp, config, restarts)
        return (out.mT if transpose else out).contiguous()
    with _matmul_precision(config.precision):
        for a, b, c in config.coefficients:
            Xf = X.float()
            gram = torch.bmm(Xf, Xf.mT)
            dist.all_reduce(gram, group=tp.group)
            gram = gram.to(compute)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            X = torch.baddbmm(X, poly, X, beta=a, alpha=1.0)
    out = X.float()
    return (out.mT if transpose else out).contiguous()


def distributed_orthogonalize(
    x: torch.Tensor,
    tp: TPLayout,
    qkv: QKVSplit | None,
    global_shape: tuple[int, int],
    config: OrthogonalizationConfig,
    scaled: bool,
) -> torch.Tensor:
    """tp_mode "distributed" for one stack; QKV parts are orthogonalized (and scaled) one by one."""
    if qkv is None:
        return distributed_newton_schulz(x, tp, config)
    k, rows, cols = x.shape
    view = x.view(k, qkv.local_groups, qkv.total, cols)
    out = torch.empty_like(view)
    offset = 0
    for size in qkv.sizes:
        part = view[:, :, offset : offset + size, :].reshape(k, qkv.local_groups * size, cols)
        o = distributed_newton_schulz(part, tp, config)
        if scaled:
            o = o * config.scale(qkv.global_groups * size, global_shape[1])
        out[:, :, offset : offset + size, :] = o.view(k, qkv.local_groups, size, cols)
        offset += size
    return out.view(k, rows, cols)


def _all_reduce_many(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Sums a list of fp32 tensors over the group with one collective."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
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
    "distributed_newton_schulz",
    "distributed_orthogonalize",
    "gather_shards",
    "local_chunk",
    "tp_namo_normalize_",
    "tp_normuon_normalize_",
]
