"""The 2026 recipe options of Muon / AdaptiveMuon against a float64 re-expression of the step:
cautious weight decay, MuonEq, Muon+, the ||X|| + eps convention, the normalization divisor, the
Polar Express table for a safety factor, and nanochat's variance reduction as normuon."""

import math

import pytest
import torch

from megatron_eopt.newton_schulz import get_coefficients
from megatron_eopt.optim import AdaptiveMuon, Muon
from megatron_eopt.optim._recipe import POLAR_EXPRESS_RAW, polar_express_rows
from optim_helpers import SHAPES, clone_params, make_grads, make_params
from reference import TOLERANCE, ns_tolerance, rel_err

LR, MOMENTUM, WD, BETA2 = 0.02, 0.9, 0.1, 0.9


def ref_newton_schulz(x, rows, *, eps=1e-7, eps_mode="clamp", divisor=1.0, row_eq=False, renorm=False):
    """float64: MuonEq, the normalization, the iteration on the short side, Muon+."""
    X = x.double()
    if row_eq:
        target = X.norm() / math.sqrt(X.shape[0])
        X = X * (target / X.norm(dim=1, keepdim=True).clamp_min(1e-6))
    norm = X.norm()
    X = X / (divisor * norm + eps if eps_mode == "add" else divisor * max(norm, torch.tensor(eps, dtype=X.dtype)))
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    for a, b, c in rows:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    if tall:
        X = X.T
    if renorm:
        X = X * (math.sqrt(min(X.shape)) / X.norm().clamp_min(1e-6))
    return X


def ref_normuon(O, v, beta2, eps):
    dim = 1 if O.shape[0] >= O.shape[1] else 0  # mean over the shorter side
    v.mul_(beta2).add_((1 - beta2) * O.square().mean(dim=dim, keepdim=True))
    U = O * v.clamp_min(eps).rsqrt()
    return U * (O.norm() / U.norm().clamp_min(eps))


def ref_steps(params, grads, *, rows, nesterov, wd_method, moment2=None, eps=1e-8, **ns):
    """Every step of every param in float64; returns the final params."""
    ps = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [None] * len(ps)
    for step_grads in grads:
        for i, (p, g) in enumerate(zip(ps, step_grads)):
            g = g.double()
            ms[i].lerp_(g, 1 - MOMENTUM)
            x = g.lerp(ms[i], MOMENTUM) if nesterov else ms[i]
            O = ref_newton_schulz(x, rows, **ns)
            if moment2 == "normuon":
                if vs[i] is None:
                    vs[i] = torch.zeros((p.shape[0], 1) if p.shape[0] >= p.shape[1] else (1, p.shape[1]),
                                        dtype=torch.float64)
                O = ref_normuon(O, vs[i], BETA2, eps)
            if wd_method == "cautious":
                p.sub_(LR * WD * p * ((O * p) >= 0))
            else:
                p.mul_(1 - LR * WD)
            p.sub_(LR * math.sqrt(max(p.shape)) * O)
    return ps


OPTIONS = {
    "cautious": dict(weight_decay_method="cautious"),
    "muoneq": dict(row_equilibration=True),
    "muon_plus": dict(frobenius_renorm=True),
    "eps_add_divisor": dict(ns_eps_mode="add", ns_norm_divisor=1.02),
    "divisor_clamp": dict(ns_norm_divisor=1.01),
    "everything": dict(weight_decay_method="cautious", row_equilibration=True, frobenius_renorm=True,
                       ns_eps_mode="add", ns_norm_divisor=1.01),
}


def _ref_kwargs(opts):
    return dict(
        wd_method=opts.get("weight_decay_method", "decoupled"),
        eps_mode=opts.get("ns_eps_mode", "clamp"),
        divisor=opts.get("ns_norm_divisor", 1.0),
        row_eq=opts.get("row_equilibration", False),
        renorm=opts.get("frobenius_renorm", False),
    )


def _worst_delta_err(params, refs, start):
    return max(rel_err(p.detach().double() - s.detach().double(), r - s.detach().double())
               for p, r, s in zip(params, refs, start))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("adaptive", [False, True])
def test_option_matches_float64_reference(name, adaptive, device, gen):
    opts = OPTIONS[name]
    params = make_params(SHAPES, gen, scale=0.1, device=device)
    start = [p.detach().cpu().clone() for p in params]
    grads = make_grads(params, gen, 3)
    common = dict(lr=LR, momentum=MOMENTUM, weight_decay=WD, nesterov=True, fp32_matmul_prec="highest", **opts)
    if adaptive:
        # nanochat's variance reduction: normuon with a 1e-10 floor
        opt = AdaptiveMuon(params, moment2_method="normuon", beta2=BETA2, eps=1e-10, **common)
    else:
        opt = Muon(params, **common)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    cpu_grads = [[g.cpu() for g in step_grads] for step_grads in grads]
    refs = ref_steps(start, cpu_grads, rows=get_coefficients("quintic", 5), nesterov=True,
                     moment2="normuon" if adaptive else None, eps=1e-10, **_ref_kwargs(opts))
    assert _worst_delta_err([p.cpu() for p in params], refs, start) <= TOLERANCE["highest"]


def test_cautious_decay_only_decays_where_update_and_weight_agree(gen):
    # One step from zero momentum: the update's sign is that of NS(g); with lr tiny next to wd the
    # decay dominates, so each element moves by -lr*wd*p exactly where the mask is on.
    p = torch.nn.Parameter(torch.randn(12, 7, generator=gen))
    q = torch.nn.Parameter(p.detach().clone())
    g = torch.randn(12, 7, generator=gen)
    on = Muon([p], lr=1e-3, momentum=0.0, weight_decay=100.0, weight_decay_method="cautious",
              fp32_matmul_prec="highest")
    plain = Muon([q], lr=1e-3, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest")
    p.grad, q.grad = g.clone(), g.clone()
    before = p.detach().clone()
    on.step()
    plain.step()
    O = ref_newton_schulz(g, get_coefficients("quintic", 5))
    mask = (O * before.double()) >= 0
    assert 0 < int(mask.sum()) < mask.numel()
    decay = (p.detach() - q.detach()).double()  # what the cautious decay alone did
    want = -1e-3 * 100.0 * before.double() * mask
    assert rel_err(decay, want) <= 1e-5
    assert torch.all(decay[~mask] == 0)


def test_eps_conventions_differ_only_for_tiny_norms(gen):
    # A gradient whose first Nesterov input has a norm near eps: "add" divides by ||X|| + eps.
    for scale, should_differ in ((1e-8, True), (1.0, False)):
        results = {}
        for mode in ("clamp", "add"):
            p = torch.nn.Parameter(torch.zeros(9, 5))
            opt = Muon([p], lr=1.0, momentum=0.0, weight_decay=0.0, ns_eps_mode=mode, ns_eps=1e-7,
                        fp32_matmul_prec="highest")
            g = torch.randn(9, 5, generator=torch.Generator().manual_seed(1)) * scale
            p.grad = g / g.norm() * scale
            opt.step()
            results[mode] = -p.detach().double() / math.sqrt(9)
            ref = ref_newton_schulz(p.grad, get_coefficients("quintic", 5), eps_mode=mode)
            assert rel_err(results[mode], ref) <= TOLERANCE["highest"], (mode, scale)
        differ = rel_err(results["add"], results["clamp"]) > 1e-2
        assert differ == should_differ, scale


def test_polar_express_table_for_a_safety_factor(gen):
    ours = polar_express_rows(1.01)
    shipped = get_coefficients("polar_express", 8)
    for row, want in zip(ours, shipped):  # the shipped table is s = 1.01 cut to 4 decimals
        assert all(abs(a - b) < 1e-4 for a, b in zip(row, want)), (row, want)
    s = 1.05
    rows = polar_express_rows(s)
    for (a, b, c), (ra, rb, rc) in zip(rows[:-1], POLAR_EXPRESS_RAW[:-1]):
        x = 0.37  # every row but the last is the raw polynomial at x / s
        assert abs(a * x + b * x**3 + c * x**5 - (ra * x / s + rb * (x / s) ** 3 + rc * (x / s) ** 5)) < 1e-12
    assert rows[-1] == POLAR_EXPRESS_RAW[-1]
    params = make_params([(24, 40), (33, 7)], gen, scale=0.1)
    start = clone_params(params)
    grads = make_grads(params, gen, 2)
    opt = Muon(params, lr=LR, momentum=MOMENTUM, weight_decay=WD, nesterov=True, fp32_matmul_prec="highest",
               coefficient_type="polar_express", num_ns_steps=10, polar_express_safety=s)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    run = [rows[min(i, len(rows) - 1)] for i in range(10)]  # past the table: the last row repeats
    refs = ref_steps(start, grads, rows=run, nesterov=True, wd_method="decoupled")
    for p, r, s0, g in zip(params, refs, start, grads[-1]):
        tol = ns_tolerance(g, "highest", "cpu", "custom", 10, run)
        assert rel_err(p.detach().double() - s0.detach().double(), r - s0.detach().double()) <= tol


@pytest.mark.parametrize("kwargs, match", [
    (dict(ns_eps_mode="sum"), "ns_eps_mode"),
    (dict(ns_norm_divisor=0.5), "ns_norm_divisor"),
    (dict(ns_norm_divisor=float("nan")), "ns_norm_divisor"),
    (dict(row_equilibration=1), "row_equilibration"),
    (dict(frobenius_renorm="yes"), "frobenius_renorm"),
    (dict(polar_express_safety=1.02), "polar_express_safety"),  # not with quintic
    (dict(coefficient_type="polar_express", polar_express_safety=0.9), "polar_express_safety"),
])
def test_bad_recipe_arguments_name_the_argument(kwargs, match, gen):
    params = make_params([(4, 3)], gen)
    with pytest.raises(ValueError, match=match):
        Muon(params, **kwargs)


def test_unknown_weight_decay_method_is_refused_by_step(gen):
    # as in Emerging-Optimizers 0.4: accepted at construction, refused by the first step that uses it
    params = make_params([(4, 3)], gen)
    opt = Muon(params, weight_decay_method="careful")
    params[0].grad = torch.randn(4, 3, generator=gen)
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match="weight_decay_method must be one of .*'cautious'.*got 'careful'"):
        opt.step()
    assert torch.equal(params[0].detach(), before)


@pytest.mark.parametrize("name", ["muoneq", "muon_plus", "eps_add_divisor", "muoneq_muon_plus_divisor"])
def test_options_on_split_qkv_parameters(name, gen):
    # The QKV path orthogonalizes each part (its rows across the query groups) as its own matrix,
    # with the recipe: one step from zero momentum is -lr * scale(part) * NS_recipe(part).
    from megatron_eopt.optim import TensorParallelMuon

    opts = dict(OPTIONS.get(name) or dict(row_equilibration=True, frobenius_renorm=True, ns_norm_divisor=1.01))
    shape, sizes, groups = (3 * 16, 24), [8, 4, 4], 3
    p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1)
    p.is_qkv = True
    start = p.detach().clone()
    g = torch.randn(shape, generator=gen) * torch.logspace(-1, 1, shape[0]).unsqueeze(-1)
    opt = TensorParallelMuon([p], lr=LR, momentum=0.0, weight_decay=0.0, split_qkv=True,
                             is_qkv_fn=lambda t: getattr(t, "is_qkv", False), qkv_split_shapes=sizes,
                             fp32_matmul_prec="highest", **opts)
    p.grad = g.clone()
    opt.step()
    ref_kw = _ref_kwargs(opts)
    ref_kw.pop("wd_method")
    ref_kw["eps"] = 1e-7  # Megatron's TensorParallelMuon floors at EO 0.3.0's 1e-7
    view = g.double().view(groups, sum(sizes), shape[1])
    want = torch.empty_like(view)
    offset = 0
    for size in sizes:
        part = view[:, offset:offset + size].reshape(groups * size, shape[1])
        o = ref_newton_schulz(part, get_coefficients("quintic", 5), **ref_kw)
        want[:, offset:offset + size] = (o * math.sqrt(max(part.shape))).view(groups, size, shape[1])
        offset += size
    delta = (p.detach().double() - start.double()) / -LR
    assert rel_err(delta, want.view(shape)) <= TOLERANCE["highest"]
    with pytest.raises(ValueError, match="tp_mode='distributed'"):
        TensorParallelMuon([torch.nn.Parameter(torch.zeros(4, 4))], tp_mode="distributed", **opts)
