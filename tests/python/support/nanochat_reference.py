"""nanochat's optimizers since January 2026 re-expressed from their behaviour, with float64 math.

- ``RefMuon2201``: ``nanochat/muon.py`` at 22a71aa (single process);
- ``RefMuonAdamW``: ``nanochat/optim.py`` as of a9d0a86 (single process).

Both keep nanochat's param groups, group keys and state layout (Muon state stacked on a group's
first parameter, in the parameters' dtype; AdamW ``step`` as an int), so their ``state_dict()``
is what nanochat's classes save and load. Each step computes in float64 and stores back.
"""

from __future__ import annotations

import math

import torch

from reference import TOLERANCE, ns_tolerance, rel_err

POLAR = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(G, steps, divisor, row_eq=False, renorm=False):
    """(k, m, n) float64: MuonEq (optional), X / (divisor·||X|| + 1e-6), the first `steps` rows
    on the short side, Muon+ (optional)."""
    X = G.clone()
    if row_eq:
        target = X.norm(dim=(-2, -1), keepdim=True) / math.sqrt(X.shape[-2])
        X = X * (target / X.norm(dim=-1, keepdim=True).clamp_min(1e-6))
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * divisor + 1e-6)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    for a, b, c in POLAR[:steps]:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if tall:
        X = X.mT
    if renorm:
        X = X * (math.sqrt(min(X.shape[-2:])) / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6))
    return X


def variance_reduction(O, v, beta2):
    """NorMuon as nanochat runs it: per-row (m >= n) or per-column statistic, floor 1e-10, the
    result rescaled to O's Frobenius norm. ``v`` (float64) is updated in place."""
    dim = -1 if O.shape[-2] >= O.shape[-1] else -2
    v.lerp_(O.square().mean(dim=dim, keepdim=True), 1 - beta2)
    U = O * v.clamp_min(1e-10).rsqrt()
    return U * (O.norm(dim=(-2, -1), keepdim=True) / U.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))


# An update element this small, relative to the largest, may change sign under fp32 rounding of the
# iteration; cautious weight decay then flips for it (decay applies where update and param agree).
CAUTIOUS_TIE = 1e-3


def muon_group_step(state, params, group, *, divisor, row_eq, renorm, ties=None):
    """One Muon group (one shape), float64; state stacked on params[0]. ``ties`` (a dict) sums, per
    param and element, the decay that a tie within rounding (CAUTIOUS_TIE) may have given or not."""
    p0 = params[0]
    m, n = p0.shape
    s = state[p0]
    if "momentum_buffer" not in s:
        s["momentum_buffer"] = torch.zeros(len(params), m, n, dtype=p0.dtype)
        s["second_momentum_buffer"] = torch.zeros((len(params), m, 1) if m >= n else (len(params), 1, n),
                                                  dtype=p0.dtype)
    G = torch.stack([p.grad for p in params]).double()
    P = torch.stack([p.detach() for p in params]).double()
    M = s["momentum_buffer"].double()
    V = s["second_momentum_buffer"].double()
    mom = group["momentum"]
    M.lerp_(G, 1 - mom)
    X = G.lerp(M, mom)
    O = polar_express(X, group["ns_steps"], divisor, row_eq, renorm)
    beta2 = group["beta2"] if group["beta2"] is not None else 0.0
    U = variance_reduction(O, V, beta2)
    lr = group["lr"] * math.sqrt(max(1.0, m / n))
    mask = (U * P) >= 0
    if ties is not None:
        tie = U.abs() <= CAUTIOUS_TIE * U.abs().amax(dim=(-2, -1), keepdim=True)
        for p, bound in zip(params, torch.where(tie, lr * group["weight_decay"] * P.abs(), 0.0)):
            ties[p] = ties.get(p, 0.0) + bound
    P = P - (lr * U + lr * group["weight_decay"] * P * mask)
    s["momentum_buffer"].copy_(M)
    s["second_momentum_buffer"].copy_(V)
    for p, new in zip(params, P):
        p.data.copy_(new)


class RefMuon2201(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.0):
        params = list(params)
        groups = [dict(params=[p for p in params if p.shape == shape]) for shape in sorted({p.shape for p in params})]
        super().__init__(groups, dict(lr=lr, momentum=momentum, ns_steps=ns_steps, beta2=beta2,
                                      weight_decay=weight_decay))
        self.ties = {}

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            muon_group_step(self.state, group["params"], group, divisor=1.02, row_eq=False, renorm=False,
                            ties=self.ties)


class RefMuonAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups):
        super().__init__(param_groups, defaults={})
        self.ties = {}

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            if group["kind"] == "muon":
                muon_group_step(self.state, group["params"], group, divisor=1.01, row_eq=True, renorm=True,
                                ties=self.ties)
                continue
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                s = self.state[p]
                if not s:
                    s["step"] = 0
                    s["exp_avg"] = torch.zeros_like(p)
                    s["exp_avg_sq"] = torch.zeros_like(p)
                s["step"] += 1
                t = s["step"]
                x, g = p.detach().double(), p.grad.double()
                m, v = s["exp_avg"].double(), s["exp_avg_sq"].double()
                x = x * (1 - group["lr"] * group["weight_decay"])
                m.lerp_(g, 1 - beta1)
                v.lerp_(g.square(), 1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt() + group["eps"]
                x = x - group["lr"] / (1 - beta1**t) * m / denom
                p.data.copy_(x)
                s["exp_avg"].copy_(m)
                s["exp_avg_sq"].copy_(v)


def assert_fp32_close(params, refs, start, grads, ties=None):
    """Each param's change within the fp32 tolerance of its float64 reference: docs/design.md §9's 1e-5, or
    fp32 rounding times what the Polar Express rows magnify it by on that param's inputs.

    ``ties`` (a reference's ``ties``, keyed by either side's tensors): an element whose cautious-decay
    decision was a tie may differ by the decay it did or did not get; it is compared apart."""
    ties = ties or {}
    for i, (p, r, s) in enumerate(zip(params, refs, start)):
        got, want = p.detach().double(), r.detach().double()
        bound = ties.get(p, ties.get(r))
        if isinstance(bound, torch.Tensor) and bool((bound > 0).any()):
            tied = bound > 0
            assert bool(((got - want).abs() <= 1.01 * bound + 1e-6)[tied].all()), (i, "a tied element")
            got = torch.where(tied, want, got)
        tol = TOLERANCE["highest"]
        if p.ndim == 2 and i < len(grads[0]):
            tol = max(ns_tolerance(step[i], "highest", "cpu", "custom", 5, POLAR) for step in grads)
        if p.ndim < 2 or min(p.shape) == 1:
            # a vector's or a 1 x n matrix's second moment is per element (AdamW; Muon's variance
            # statistic of a single row): an element whose momentum cancels carries its absolute
            # rounding as a relative one (AdaMuon's case, compared at the "high" tolerance elsewhere)
            tol = TOLERANCE["high"]
        err = rel_err(got - s.double(), want - s.double())
        assert err <= tol, (i, tuple(p.shape), err, tol)
