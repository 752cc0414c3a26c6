"""MuonBP (Khaled et al., "MuonBP: Faster Muon via Block-Periodic Orthogonalization", arXiv
2510.16981): a different algorithm from Muon, opt in with ``Muon(block_period=P)``.

On P - 1 of every P steps each rank orthogonalizes its own shard of a matrix sharded across ranks
(a DTensor the sharded path would gather to an owner) as if it were the matrix: no communication,
the Muon scale of the shard's shape, the step size ``lr·block_lr_scale``. Every P-th step is a full
Muon step (the owner or gather path). P = 1 is Muon. Matrices whole on every rank (replicated,
local, or expert batches sharded on their expert dim) are unaffected: their block is the matrix.
"""

from __future__ import annotations

import torch


def check_block_period(block_period, block_lr_scale) -> None:
    if block_period is not None and (isinstance(block_period, bool) or not isinstance(block_period, int)
                                     or block_period < 1):
        raise ValueError(f"block_period must be None or an integer >= 1, got {block_period!r}")
    if isinstance(block_lr_scale, bool) or not isinstance(block_lr_scale, (int, float)) or not block_lr_scale > 0:
        raise ValueError(f"block_lr_scale must be a number > 0, got {block_lr_scale!r}")


def block_orthogonalize(cfg, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The raw Newton–Schulz of each local shard (2-D, or an (E, m, n) batch), equal shapes batched;
    an empty shard gives an empty result."""
    outs: list[torch.Tensor | None] = [None] * len(inputs)
    by_shape: dict[tuple, list[int]] = {}
    for j, x in enumerate(inputs):
        if x.numel() == 0:
            outs[j] = torch.zeros_like(x)
        elif x.ndim == 3:
            outs[j] = cfg.newton_schulz(x)
        else:
            by_shape.setdefault(tuple(x.shape), []).append(j)
    for js in by_shape.values():
        results = cfg.newton_schulz(torch.stack([inputs[j] for j in js])).unbind(0)
        for j, r in zip(js, results):
            outs[j] = r
    return outs


def block_scale(cfg, shape: tuple[int, ...], block_lr_scale: float) -> float:
    """The update scale of a shard on a block step: Muon's scale of its own (m, n), times the block
    step size's ratio to lr."""
    m, n = shape[-2:]
    return cfg.scale(max(m, 1), max(n, 1)) * float(block_lr_scale)
