"""The distributed Newton–Schulz iteration (Megatron's tp_mode "distributed", docs/design.md §4.9): each
rank holds a shard of every matrix, and the result is each rank's shard of the unsharded result.

Newton–Schulz cannot call a collective from inside the fused op, so it runs here in plain PyTorch
on the local shards, batched: one all-reduce of the k squared Frobenius norms, then per iteration
one all-reduce of the k Gram matrices (of the unsharded side, as in Megatron: partition_dim 0
iterates on the transpose). The Gram partials are summed in fp32 (bf16 products accumulate in
fp32, like the fused op's GEMMs) and rounded to the compute dtype once, after the sum. Where the
fused op would take the Gram iteration for the global matrix (same choice and restarts,
ns_algorithm.h), it runs here too: the s x s recursion needs no communication, so there is one
Gram all-reduce per (re)start instead of one per iteration.

:func:`newton_schulz` with ``tp_group`` and the optimizers' tensor-parallel step both run it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

from .. import _collectives as collectives
from .._library import ns_plan
from .._precision import products_precision
from ..step_stats import count_newton_schulz
from ..coefficients import coefficient_table, get_coefficients


@functools.lru_cache(maxsize=256)
def gram_restarts(table: tuple[float, ...], steps: int, repeat_last: bool, m: int, n: int, transpose: bool,
                  precision: str, algorithm: str, device_type: str):
    """The restart flags when the fused op would run the Gram iteration on this global matrix, else None."""
    use_gram, restarts = ns_plan(table, steps, repeat_last, m, n, transpose, precision, algorithm, device_type)
    return restarts if use_gram else None


def _distributed_gram(X: torch.Tensor, group, coefficients: Sequence[Sequence[float]], restarts) -> torch.Tensor:
    """The Gram iteration (docs/design.md §4.4) on local shards X (k, s, l_local) of the working matrices:
    R = sum over ranks of X X^T (one all-reduce per (re)start), then the s x s recursion, identical
    on every rank, and X Q-applied locally. R and Q stay fp32; X keeps the compute dtype (bf16 for
    "medium", rounded after each restart as in the fused op)."""
    compute = X.dtype

    def gram(W):
        Wf = W.float()
        R = torch.bmm(Wf, Wf.mT)
        collectives.all_reduce(R, group=group)
        return R

    R = gram(X)
    Q = None
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
    x: torch.Tensor,
    group,
    size: int,
    partition_dim: int,
    *,
    coefficients: Sequence[Sequence[float]],
    table: tuple[float, ...],
    steps: int,
    repeat_last: bool,
    precision: str,
    algorithm: str,
    eps: float,
) -> torch.Tensor:
    """Newton–Schulz of a batch ``x`` (k, m_local, n_local) of matrices sharded over ``group`` (of
    ``size`` ranks) along ``partition_dim`` (0: rows, 1: columns), equal to the unsharded result
    (docs/design.md §4.1, §4.9). ``coefficients``: the (a, b, c) row of each of the ``steps`` iterations;
    ``table`` and ``repeat_last``: the schedule as the fused op takes it (flattened), which decides
    with ``precision`` and ``algorithm`` whether the Gram iteration runs."""
    transpose = partition_dim == 0  # iterate so that the sharded side is the contracted one
    w = x.mT if transpose else x
    sq = w.square().sum(dim=(-2, -1))
    collectives.all_reduce(sq, group=group)
    norm = sq.sqrt().clamp_min(eps)
    compute = torch.bfloat16 if precision == "medium" else torch.float32
    X = (w / norm[:, None, None]).to(compute)
    s, l_global = w.shape[-2], w.shape[-1] * size
    m, n = (l_global, s) if transpose else (s, l_global)
    count_newton_schulz((w.shape[0], m, n), steps, shared_over=size)
    restarts = gram_restarts(table, steps, repeat_last, m, n, transpose, precision, algorithm, x.device.type)
    if restarts is not None:
        with products_precision(precision):  # the plain-PyTorch iteration: "high" is TF32
            out = _distributed_gram(X, group, coefficients, restarts)
        return (out.mT if transpose else out).contiguous()
    with products_precision(precision):  # the plain-PyTorch iteration: "high" is TF32
        for a, b, c in coefficients:
            Xf = X.float()
            gram = torch.bmm(Xf, Xf.mT)
            collectives.all_reduce(gram, group=group)
            gram = gram.to(compute)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            X = torch.baddbmm(X, poly, X, beta=a, alpha=1.0)
    out = X.float()
    return (out.mT if transpose else out).contiguous()


def _tensor_parallel_newton_schulz(
    x, steps, coefficient_type, custom_coefficient_sets, eps, transpose, tp_group, precision, algorithm
) -> torch.Tensor:
    """The distributed iteration of Megatron's tp_mode "distributed" over ``tp_group`` (docs/design.md §4.9)."""
    table, repeat_last = coefficient_table(coefficient_type, custom_coefficient_sets)
    if transpose is None:
        transpose = x.size(-2) > x.size(-1)
    # distributed_newton_schulz contracts the sharded side: rows sharded means iterating on X^T.
    out = distributed_newton_schulz(
        x if x.ndim == 3 else x.unsqueeze(0),
        tp_group,
        dist.get_world_size(tp_group),
        0 if transpose else 1,
        coefficients=tuple(get_coefficients(coefficient_type, steps, custom_coefficient_sets)),
        table=tuple(float(v) for row in table for v in row),
        steps=steps,
        repeat_last=repeat_last,
        precision=precision,
        algorithm=algorithm,
        eps=eps,
    )
    return out if x.ndim == 3 else out.squeeze(0)
