"""NorMuon and NAMO (docs/design.md §4.7) on sharded matrices: statistics of the full matrices from the local shards.

Each rank computes its shard's partial sums; one all-reduce per mesh group (``_reduce_dims``)
sums them over the mesh dims that shard the reduced dims, so every rank scales its shard by the
whole matrix's statistics. Where the statistics' state lives is ``dtensor_layout``'s
(``statistic_placements``, ``zeros_state``).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import _collectives as collectives
from .dtensor_layout import ShardLayout

def _reduce_dims(tensors, layouts, view_dims) -> None:
    """Sums tensors[k] in place over the mesh dims that shard view dims view_dims[k] of layouts[k]
    (one all-reduce per mesh group; replicated mesh dims hold equal values and are left alone)."""
    by_group: dict[int, tuple[Any, list[int]]] = {}
    for k, (lay, vd) in enumerate(zip(layouts, view_dims)):
        for i in sorted({i for d in vd for i in lay.shard_dims.get(d, ())}):
            g = lay.mesh.get_group(i)
            by_group.setdefault(id(g), (g, []))[1].append(k)
    for g, ks in by_group.values():
        flat = torch.cat([tensors[k].reshape(-1) for k in ks])
        collectives.all_reduce(flat, group=g)
        for k, chunk in zip(ks, flat.split([tensors[k].numel() for k in ks])):
            tensors[k].copy_(chunk.view_as(tensors[k]))


def _matrix_dims(lay: ShardLayout) -> tuple[int, int]:
    nd = len(lay.view_shape)
    return (nd - 2, nd - 1)


def sharded_normuon_(updates, moment2, layouts, normuon_dims, *, beta2, eps, found_inf=None) -> None:
    """NorMuon (docs/design.md §4.7) on local (E, m, n) views of sharded matrices, statistics of the full ones.

    moment2[k] is the (E, m, 1) or (E, 1, n) local view; normuon_dims[k] is -1 or -2.
    """
    sums = [u.square().sum(dim=nd, keepdim=True) for u, nd in zip(updates, normuon_dims)]
    _reduce_dims(sums, layouts, [(len(l.view_shape) + nd,) for l, nd in zip(layouts, normuon_dims)])
    eps32 = eps.to(torch.float32)
    norms, steps = [], []
    for u, v, s, lay, nd in zip(updates, moment2, sums, layouts, normuon_dims):
        mean = s / lay.view_shape[nd]
        new_v = torch.lerp(v.float(), mean, (1 - beta2).to(mean.dtype))
        v.copy_(new_v if found_inf is None else torch.where(found_inf != 0, v, new_v))
        step = u * new_v.clamp_min(eps32).rsqrt()
        norms.append(torch.stack([u.square().sum(dim=(-2, -1)), step.square().sum(dim=(-2, -1))]))
        steps.append(step)
    _reduce_dims(norms, layouts, [_matrix_dims(l) for l in layouts])
    for u, step, n in zip(updates, steps, norms):
        u.copy_(step * (n[0].sqrt() / n[1].sqrt().clamp_min(eps32))[:, None, None])


def sharded_namo_(updates, moment2, grads, ns_inputs, layouts, *, beta2, eps, grad_scale=None, found_inf=None) -> None:
    """NAMO (docs/design.md §4.7) on local (E, m, n) views of sharded matrices; moment2[k] is the (E,) view."""
    sums = [torch.stack([g.float().square().sum(dim=(-2, -1)), x.square().sum(dim=(-2, -1))])
            for g, x in zip(grads, ns_inputs)]
    _reduce_dims(sums, layouts, [_matrix_dims(l) for l in layouts])
    eps32 = eps.to(torch.float32)
    for u, v, s in zip(updates, moment2, sums):
        grad_sq = s[0] if grad_scale is None else s[0] / grad_scale.float().square()
        new_v = torch.lerp(v.float(), grad_sq, (1 - beta2).to(grad_sq.dtype))
        v.copy_(new_v if found_inf is None else torch.where(found_inf != 0, v, new_v))
        u.mul_((s[1].sqrt() / (new_v.sqrt() + eps32))[:, None, None])
