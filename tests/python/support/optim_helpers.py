"""Shared pieces of the optimizer tests: parameter sets, step drivers, a float64 reference step."""

from __future__ import annotations

import torch

from megatron_eopt.newton_schulz import get_muon_scale_factor
from reference import newton_schulz_ref, rel_err

# Awkward shapes (docs/design.md §9): row / column vectors, primes both ways, square, repeats (batched).
SHAPES = [(1, 9), (9, 1), (97, 37), (37, 97), (16, 16), (24, 40), (24, 40), (40, 24)]


def make_params(shapes, gen, dtype=torch.float32, scale=1.0, device="cpu"):
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * scale).to(device, dtype)) for s in shapes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def make_grads(params, gen, steps, skip=()):
    """Per step, one gradient per param (None for the indices in `skip`)."""
    return [
        [None if i in skip else torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for i, p in enumerate(params)]
        for _ in range(steps)
    ]


def run_steps(opt, params, grads_per_step, lrs=None):
    for t, grads in enumerate(grads_per_step):
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[t]
        opt.step()


def max_delta_err(params, ref_params, start):
    """Largest ||Δ - Δ_ref|| / ||Δ_ref|| over the params (Δ: change since `start`)."""
    worst = 0.0
    for p, r, s in zip(params, ref_params, start):
        d, dr = p.detach().double() - s.double(), r.detach().double() - s.double()
        if dr.norm() == 0:
            assert d.norm() == 0
            continue
        worst = max(worst, rel_err(d, dr))
    return worst


def max_delta_err_without_flips(params, ref_params, start, max_flip_fraction=0.005, flip_threshold=0.5):
    """max_delta_err over the elements whose change agrees with the reference to within
    `flip_threshold` of it (half, by default).

    For elementwise-normalized updates (AdaMuon: O / sqrt(v), whose first step is sign(O) /
    sqrt(1 - beta2)), two bf16 implementations round a near-zero entry of O to opposite signs now
    and then, which moves that element by a full step while the rest agree to bf16 accuracy. In
    fp32 the same division turns an entry small in both O and v into one carrying a large share
    of its own relative rounding error (seen: 6% of its step on one of 960 elements, while the
    others agree to 1e-5). At most `max_flip_fraction` of each param's elements may be such flips.
    """
    worst = 0.0
    for p, r, s in zip(params, ref_params, start):
        d, dr = p.detach().double() - s.double(), r.detach().double() - s.double()
        flips = (d - dr).abs() > flip_threshold * dr.abs()
        assert flips.sum().item() <= max(1, max_flip_fraction * d.numel()), f"{int(flips.sum())} of {d.numel()} differ"
        keep = ~flips
        if dr[keep].norm() == 0:
            continue
        worst = max(worst, rel_err(d[keep], dr[keep]))
    return worst


def continued_delta_err(opt, params, ref_opt, ref_params, grads_per_step):
    """Runs both optimizers on the same grads; the worst relative error of their param changes."""
    start = [p.detach().clone() for p in params]
    ref_start = [p.detach().clone() for p in ref_params]
    run_steps(opt, params, grads_per_step)
    run_steps(ref_opt, ref_params, grads_per_step)
    return max(
        rel_err(p.detach().double() - s.double(), r.detach().double() - rs.double())
        for p, s, r, rs in zip(params, start, ref_params, ref_start)
    )


def max_state_err(opt, params, ref_opt, ref_params, keys=("momentum_buffer",)):
    worst = 0.0
    for p, r in zip(params, ref_params):
        for k in keys:
            a, b = opt.state[p][k], ref_opt.state[r][k]
            assert a.shape == b.shape and a.dtype == b.dtype, (k, a.shape, b.shape, a.dtype, b.dtype)
            if b.norm() > 0:
                worst = max(worst, rel_err(a, b))
    return worst


class ReferenceMuon:
    """docs/design.md §4.6 / §4.7 in float64 (Newton–Schulz in float64 too), one state dict per param.

    qkv: {param index: split sizes} orthogonalizes those per part (docs/design.md §4.8).
    """

    def __init__(
        self,
        params,
        lr,
        momentum,
        weight_decay,
        nesterov,
        weight_decay_method="decoupled",
        coefficient_type="quintic",
        num_ns_steps=5,
        scale_mode="spectral",
        extra_scale_factor=1.0,
        moment2_method=None,
        beta2=0.95,
        eps=1e-8,
        qkv=None,
        custom=None,
    ):
        self.params = [p.detach().double().clone() for p in params]
        self.lr, self.mu, self.wd, self.nesterov = lr, momentum, weight_decay, nesterov
        self.wdm, self.coef, self.steps = weight_decay_method, coefficient_type, num_ns_steps
        self.scale_mode, self.extra = scale_mode, extra_scale_factor
        self.m2, self.beta2, self.eps = moment2_method, beta2, eps
        self.qkv = qkv or {}
        self.custom = custom
        self.M = [torch.zeros_like(p) for p in self.params]
        self.V = [None] * len(self.params)

    def _scale(self, m, n):
        return get_muon_scale_factor(m, n, self.scale_mode) * self.extra

    def _ns(self, x):
        return newton_schulz_ref(x, self.steps, self.coef, self.custom)

    def _orth_parts(self, i, x):
        """Raw NS of x (whole or per QKV part) and the per-row scale tensor."""
        if i not in self.qkv:
            return self._ns(x), torch.full((x.shape[0], 1), self._scale(*x.shape), dtype=x.dtype)
        sizes = self.qkv[i]
        total, n = sum(sizes), x.shape[1]
        groups = x.shape[0] // total
        view = x.view(groups, total, n)
        out, scale = torch.empty_like(view), torch.empty(groups, total, 1, dtype=x.dtype)
        off = 0
        for s in sizes:
            part = view[:, off : off + s].reshape(groups * s, n)
            out[:, off : off + s] = self._ns(part).view(groups, s, n)
            scale[:, off : off + s] = self._scale(groups * s, n)
            off += s
        return out.view_as(x), scale.view(-1, 1)

    def step(self, grads):
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            g = g.double()
            lr, wd = self.lr, self.wd
            if self.wdm == "decoupled":
                p -= lr * wd * p
            elif self.wdm == "independent":
                p -= wd * p
            elif self.wdm == "palm":
                p -= lr * lr * wd * p
            else:
                g = g + wd * p
            self.M[i] = self.M[i] + (1 - self.mu) * (g - self.M[i])
            x = g + self.mu * (self.M[i] - g) if self.nesterov else self.M[i]
            o, scale = self._orth_parts(i, x)
            if self.m2 == "adamuon":
                v = self.V[i] if self.V[i] is not None else torch.zeros_like(o)
                self.V[i] = v = self.beta2 * v + (1 - self.beta2) * o.square()
                o = o / (v.sqrt() + self.eps)
            elif self.m2 == "normuon":
                dim = -1 if o.shape[0] >= o.shape[1] else -2
                r = o.square().mean(dim=dim, keepdim=True)
                v = self.V[i] if self.V[i] is not None else torch.zeros_like(r)
                self.V[i] = v = self.beta2 * v + (1 - self.beta2) * r
                u = o * v.clamp_min(self.eps).rsqrt()
                o = u * (o.norm() / u.norm().clamp_min(self.eps))
            elif self.m2 == "namo":
                v = self.V[i] if self.V[i] is not None else torch.zeros(1, dtype=o.dtype)
                self.V[i] = v = self.beta2 * v + (1 - self.beta2) * g.norm().square()
                o = o * (x.norm() / (v.sqrt() + self.eps))
            p -= lr * scale * o


def assert_finite(*tensors):
    for t in tensors:
        assert torch.isfinite(t).all(), "non-finite values"


__all__ = [
    "SHAPES",
    "ReferenceMuon",
    "assert_finite",
    "clone_params",
    "continued_delta_err",
    "make_grads",
    "make_params",
    "max_delta_err",
    "max_state_err",
    "run_steps",
]


def matrix_blocks(t, keys):
    """The (out, in) matrices a stored weight holds under param-group keys, cut by hand: one matrix
    (size(0), -1) for "flatten", one per leading index for "batch", transposed for "in_out", the
    rows of each group's parts for "split_shapes"."""
    if keys.get("nd_mode") == "flatten":
        mats = [t.reshape(t.shape[0], -1)]
    elif keys.get("nd_mode") == "batch":
        mats = list(t.reshape(-1, *t.shape[-2:]).unbind(0))
    else:
        mats = [t]
    out = []
    for m in mats:
        m = m.mT if keys.get("matrix_layout") == "in_out" else m
        split = keys.get("split_shapes")
        if split is None:
            out.append(m)
            continue
        g = m.unflatten(0, (m.shape[0] // sum(split), sum(split)))
        at = 0
        for size in split:
            out.append(g[:, at:at + size].flatten(0, 1))
            at += size
    return out


def tp_gtp_piece(t, pd, pad, tp, gtp):
    """This rank's piece of a full weight as Megatron lays it out: the tensor-parallel chunk along
    ``pd`` (-1: replicated over TP), then, with ``pad`` given, its rows padded by ``pad`` zero rows and
    chunked over GTP (``tp``, ``gtp``: (rank, size))."""
    if pd != -1:
        t = t.chunk(tp[1], dim=pd)[tp[0]]
    if pad is not None:
        t = torch.cat([t, t.new_zeros(pad, t.shape[1])]).chunk(gtp[1])[gtp[0]]
    return t.contiguous().clone()
