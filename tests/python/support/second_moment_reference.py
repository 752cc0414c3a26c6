"""Plain-PyTorch float64 references of the second-moment normalizations and the split
orthogonalization (docs/design.md §4.7, §4.8), written from the formulas, independent of the package."""

from __future__ import annotations

import torch

from megatron_eopt.newton_schulz import get_muon_scale_factor
from reference import newton_schulz_ref


def _ema(v, target, beta2):
    return beta2 * v + (1.0 - beta2) * target


def adamuon_ref(o, v, beta2=0.95, eps=1e-8):
    """Returns (normalized O, new v), float64."""
    o, v = o.double(), v.double()
    v = _ema(v, o * o, beta2)
    return o / (v.sqrt() + eps), v


def normuon_ref(o, v, beta2=0.95, eps=1e-8):
    o, v = o.double(), v.double()
    m, n = o.shape
    r = (o * o).mean(dim=1 if m >= n else 0, keepdim=True)  # over the shorter side
    v = _ema(v, r, beta2)
    u = o * v.clamp_min(eps).rsqrt()
    return u * (o.norm() / u.norm().clamp_min(eps)), v


def namo_ref(o, v, grad, ns_input, beta2=0.95, eps=1e-8):
    o, v = o.double(), v.double()
    v = _ema(v, grad.double().norm() ** 2, beta2)
    return o * (ns_input.double().norm() / (v.sqrt() + eps)), v


def split_ref(x, split_sizes, num_groups, scale_mode="spectral", extra_scale_factor=1.0, dtype=torch.float64,
              **ns_kwargs):
    """Megatron's QKV split written out: view, split, orthogonalize each part alone, scale, concat."""
    rows, n = x.shape
    parts = torch.split(x.reshape(num_groups, sum(split_sizes), n), list(split_sizes), dim=1)
    outs = []
    for part in parts:
        matrix = part.reshape(-1, n)
        o = newton_schulz_ref(matrix, dtype=dtype, **ns_kwargs)
        if scale_mode is not None:
            o = o * get_muon_scale_factor(matrix.shape[0], n, scale_mode) * extra_scale_factor
        outs.append(o.reshape(num_groups, -1, n))
    return torch.cat(outs, dim=1).reshape(rows, n)
