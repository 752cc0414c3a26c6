"""Parity with Emerging-Optimizers 0.4.0 (imported beside 0.3.0, see eo040.py): every class of the
orthogonalized family, the fused step and the per-parameter step an overridden extension point
selects, the weight-update hooks, Newton–Schulz options, spectral clipping and the registry.

fp32 matmuls ("highest") are compared at DESIGN §6's 1e-5 on the parameter changes over a few
steps with fresh random gradients; EO's default "medium" (bf16) at 2e-2.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch

import eo040
import megatron_eopt as me
from megatron_eopt import optim, registry
from megatron_eopt.optim import spectral_clipping
from megatron_eopt.optim.polargrad import left_polargrad_orth_fn, right_polargrad_orth_fn
from optim_helpers import clone_params, make_grads, make_params, max_delta_err, max_delta_err_without_flips, run_steps
from reference import TOLERANCE, ns_tolerance, rel_err

eo = eo040.load()

SHAPES = [(1, 9), (9, 1), (97, 37), (37, 97), (16, 16), (24, 40), (24, 40)]
STEPS = 3


def _compare(ours_cls, eo_cls, kwargs, gen, shapes=SHAPES, eo_kwargs=None, tol=TOLERANCE["highest"],
             scale=1.0, err=max_delta_err, state_keys=("momentum_buffer",)):
    params = make_params(shapes, gen, scale=scale)
    ref = clone_params(params)
    start = [p.detach().clone() for p in params]
    ours = ours_cls(params, **kwargs)
    theirs = eo_cls(ref, **(kwargs if eo_kwargs is None else eo_kwargs))
    grads = make_grads(params, gen, STEPS)
    run_steps(ours, params, grads)
    run_steps(theirs, ref, grads)
    assert err(params, ref, start) <= tol
    for p, r in zip(params, ref):
        for key in state_keys:
            assert rel_err(ours.state[p][key], theirs.state[r][key]) <= tol, key
    return ours


# ------------------------------------------------------------------ Muon, AdaptiveMuon: fused and hook paths
@pytest.mark.parametrize("wd_method", ["decoupled", "independent", "l2", "palm"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_muon(wd_method, nesterov, gen):
    kwargs = dict(lr=0.05, weight_decay=0.1, nesterov=nesterov, weight_decay_method=wd_method,
                  fp32_matmul_prec="highest")
    opt = _compare(optim.Muon, eo.muon.Muon, kwargs, gen)
    assert opt._use_fused_step()


@pytest.mark.parametrize("coefficient_type", ["cubic5", "polar_express", "deepseekv4"])
def test_muon_coefficient_types(coefficient_type, gen):
    steps = 5 if coefficient_type == "cubic5" else 7
    kwargs = dict(lr=0.05, coefficient_type=coefficient_type, num_ns_steps=steps, fp32_matmul_prec="highest")
    _compare(optim.Muon, eo.muon.Muon, kwargs, gen, shapes=[(24, 40), (40, 24), (16, 16)],
             tol=max(TOLERANCE["highest"], 5 * ns_tolerance(torch.randn(24, 40), "highest", "cpu", coefficient_type)))


def test_muon_default_precision_is_bf16(gen):
    _compare(optim.Muon, eo.muon.Muon, dict(lr=0.05), gen, shapes=[(64, 48), (48, 64)], tol=TOLERANCE["medium"])


def test_muon_tiny_gradients_follow_eps_1e15(gen):
    # A gradient of norm ~1e-9 is orthogonalized to a full-size update (0.4's eps), not shrunk (0.3.0's).
    _compare(optim.Muon, eo.muon.Muon, dict(lr=0.05, fp32_matmul_prec="highest", weight_decay=0.0), gen,
             shapes=[(24, 40), (16, 16)], scale=1.0)
    params = make_params([(24, 40)], gen)
    opt = optim.Muon(params, lr=1.0, weight_decay=0.0, momentum=0.0, fp32_matmul_prec="highest")
    ref = clone_params(params)
    eo_opt = eo.muon.Muon(ref, lr=1.0, weight_decay=0.0, momentum=0.0, fp32_matmul_prec="highest")
    start = params[0].detach().clone()
    g = torch.randn(24, 40, generator=gen) * 1e-9 / 31.0
    params[0].grad, ref[0].grad = g.clone(), g.clone()
    opt.step()
    eo_opt.step()
    update = start - params[0].detach()
    assert rel_err(update, start - ref[0].detach()) <= TOLERANCE["highest"]
    assert 0.9 < float(update.square().mean().sqrt()) < 1.1  # spectral scale: RMS about 1


@pytest.mark.parametrize("method", ["adamuon", "normuon", "namo"])
def test_adaptive_muon(method, gen):
    kwargs = dict(lr=0.05, momentum=0.9, weight_decay=0.1, moment2_method=method, fp32_matmul_prec="highest")
    # AdaMuon divides elementwise by sqrt(v): an entry small in both O and v carries a large share
    # of its own fp32 rounding (EO itself lands up to 4e-4 from float64). As in the 0.3.0 suite,
    # elements off by 1% of their own change are counted apart (at most 0.5%) and the bound is TF32's.
    adamuon = method == "adamuon"
    err = functools.partial(max_delta_err_without_flips, flip_threshold=0.01) if adamuon else max_delta_err
    opt = _compare(optim.AdaptiveMuon, eo.adaptive_muon.AdaptiveMuon, kwargs, gen, err=err,
                   tol=TOLERANCE["high"] if adamuon else TOLERANCE["highest"],
                   state_keys=("momentum_buffer", "moment2_buffer"))
    assert opt._use_fused_step()


def _eo_identity_override(base, name):
    """A subclass of ``base`` whose ``name`` calls the base method: behaviour unchanged, but overridden."""
    def method(self, *args, **kwargs):
        return getattr(super(cls, self), name)(*args, **kwargs)

    cls = type(f"Overriding{name}", (base,), {name: method})
    return cls


@pytest.mark.parametrize("name", ["_apply_moment2_normalization", "_apply_muon_scale", "_match_frobenius_norm",
                                  "pre_weight_update_fn_inplace", "_apply_weight_decay_inplace"])
@pytest.mark.parametrize("method", ["normuon", "namo"])
def test_adaptive_muon_hook_path_has_fused_numerics(name, method, gen):
    cls = _eo_identity_override(optim.AdaptiveMuon, name)
    kwargs = dict(lr=0.05, momentum=0.9, weight_decay=0.1, moment2_method=method, fp32_matmul_prec="highest")
    opt = _compare(cls, eo.adaptive_muon.AdaptiveMuon, kwargs, gen, state_keys=("momentum_buffer", "moment2_buffer"))
    assert not opt._use_fused_step() and name in opt.overridden_extension_points()


def _clip_update(self, p, update):
    update.clamp_(-0.01, 0.01)


def _shrink_weight(self, p):
    p.mul_(0.99)


def _decay_toward_one(self, p, grad, lr, weight_decay):
    p.sub_(p.sign(), alpha=lr * weight_decay)


@pytest.mark.parametrize("overrides", [
    {"pre_weight_update_fn_inplace": _clip_update},
    {"post_weight_update_fn_inplace": _shrink_weight},
    {"_apply_weight_decay_inplace": _decay_toward_one},
    {"pre_weight_update_fn_inplace": _clip_update, "post_weight_update_fn_inplace": _shrink_weight},
])
def test_overridden_extension_points_are_called(overrides, gen):
    # The same override on EO's Muon and on ours: ours leaves the fused step and calls it as EO does.
    ours = type("OursCustom", (optim.Muon,), dict(overrides))
    theirs = type("EOCustom", (eo.muon.Muon,), dict(overrides))
    opt = _compare(ours, theirs, dict(lr=0.05, weight_decay=0.1, fp32_matmul_prec="highest"), gen)
    assert not opt._use_fused_step()
    assert sorted(opt.overridden_extension_points()) == sorted(overrides)


def test_replaced_scaled_orthogonalize_fn_is_used(gen):
    def sign_update(grad):
        return grad.sign() * 0.5

    params = make_params([(12, 20), (20, 12)], gen)
    ref = clone_params(params)
    start = [p.detach().clone() for p in params]
    opt = optim.Muon(params, lr=0.1, fp32_matmul_prec="highest")
    opt.scaled_orthogonalize_fn = sign_update
    theirs = eo.muon.Muon(ref, lr=0.1, fp32_matmul_prec="highest")
    theirs.scaled_orthogonalize_fn = sign_update
    grads = make_grads(params, gen, STEPS)
    run_steps(opt, params, grads)
    run_steps(theirs, ref, grads)
    assert max_delta_err(params, ref, start) <= TOLERANCE["highest"]


@pytest.mark.parametrize("nesterov", [False, True])
def test_base_class_with_eo_constructor(nesterov, gen):
    def row_normalize(grad):
        return grad / grad.norm(dim=-1, keepdim=True).clamp_min(1e-8)

    kwargs = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=nesterov, weight_decay_method="decoupled",
                  fp32_matmul_prec="highest", scaled_orthogonalize_fn=row_normalize)
    base = eo.orthogonalized_optimizer.OrthogonalizedOptimizer
    opt = _compare(optim.OrthogonalizedOptimizer, base, kwargs, gen)
    assert not opt._use_fused_step()
    # extra keyword arguments become param-group defaults, as in EO
    extra = optim.OrthogonalizedOptimizer(make_params([(4, 4)], gen), 0.1, 0.9, 0.0, nesterov=False,
                                          weight_decay_method="decoupled", fp32_matmul_prec="highest", beta2=0.5)
    assert extra.param_groups[0]["beta2"] == 0.5


def test_base_class_errors_where_eo_raises(gen):
    kwargs = dict(nesterov=False, weight_decay_method="decoupled", fp32_matmul_prec="highest")
    p3 = torch.nn.Parameter(torch.randn(2, 3, 4, generator=gen))
    opt = optim.OrthogonalizedOptimizer([p3], 0.1, 0.9, 0.0, **kwargs)  # accepted at construction, as in EO
    p3.grad = torch.randn_like(p3)
    with pytest.raises(ValueError, match="Only 2D parameters are supported"):
        opt.step()
    with pytest.raises(ValueError, match="closure is not supported"):
        opt.step(lambda: 0.0)
    p = torch.nn.Parameter(torch.randn(3, 4, generator=gen))
    bad = optim.OrthogonalizedOptimizer([p], 0.1, 0.9, 0.1, nesterov=False, weight_decay_method="ridge",
                                        fp32_matmul_prec="highest")
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="Invalid weight decay method: ridge"):
        bad.step()
    assert torch.equal(p.detach(), before)


# ------------------------------------------------------------------ where and as EO raises
FAMILY = ["Muon", "AdaptiveMuon", "Scion", "MOP", "MuonHyperball", "PolarGrad", "Spel", "Muown"]
EO_CLASSES = {
    "Muon": lambda: eo.muon.Muon, "AdaptiveMuon": lambda: eo.adaptive_muon.AdaptiveMuon,
    "Scion": lambda: eo.scion.Scion, "MOP": lambda: eo.mop.MOP,
    "MuonHyperball": lambda: eo.muon_hyperball.MuonHyperball, "PolarGrad": lambda: eo.polargrad.PolarGrad,
    "Spel": lambda: eo.spel.Spel, "Muown": lambda: eo.muown.Muown,
}


def _error_cases():
    cases = []
    for name in FAMILY:
        for label, shapes in [("1d", [(4, 6), (7,)]), ("3d", [(4, 6), (2, 4, 3)]), ("0d", [(4, 6), ()])]:
            cases += [(name, label, shapes, {}, True), (name, label + "-nograd", shapes, {}, False)]
        signature = inspect.signature(EO_CLASSES[name]().__init__).parameters
        for arg, value in [("weight_decay_method", "ridge"), ("coefficient_type", "cubic"), ("coefficient_type", "custom"),
                           ("scale_mode", "rms"), ("moment2_method", "adam")]:
            if arg in signature:
                cases += [(name, f"{arg}={value}", [(4, 6), (6, 4)], {arg: value}, True),
                          (name, f"{arg}={value}-nograd", [(4, 6), (6, 4)], {arg: value}, False)]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in cases]


def _outcome(cls, name, shapes, kwargs, with_grads, seed):
    """('construction' | 'step' | 'ok', exception type) and whether the params / state stayed unchanged."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    kwargs = dict(kwargs)
    if name == "AdaptiveMuon":
        kwargs.update(lr=0.01, momentum=0.9, weight_decay=0.1)
    if name == "MuonHyperball":
        with torch.no_grad():
            for p in params:
                p.div_(p.norm())
        kwargs["hyperball_radius"] = 1.0
    try:
        opt = cls(params, **kwargs)
    except Exception as e:  # noqa: BLE001 - the type is the result
        return ("construction", type(e)), True
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    before = [p.detach().clone() for p in params]
    if with_grads:
        for p, g in zip(params, grads):
            p.grad = g
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001
        unchanged = all(torch.equal(p, b) for p, b in zip(params, before)) and not any(opt.state.values())
        return ("step", type(e)), unchanged
    return ("ok", None), True


@pytest.mark.parametrize("name,label,shapes,kwargs,with_grads", _error_cases())
def test_errors_are_raised_where_and_as_eo_raises_them(name, label, shapes, kwargs, with_grads):
    theirs, _ = _outcome(EO_CLASSES[name](), name, shapes, kwargs, with_grads, seed=1)
    ours, unchanged = _outcome(getattr(optim, name), name, shapes, kwargs, with_grads, seed=1)
    assert ours == theirs
    assert unchanged  # unlike EO, nothing is half-updated when step() raises


def test_step_time_errors_keep_our_messages(gen):
    p, v = torch.nn.Parameter(torch.randn(4, 6, generator=gen)), torch.nn.Parameter(torch.randn(6, generator=gen))
    p.grad, v.grad = torch.randn(4, 6, generator=gen), torch.randn(6, generator=gen)
    with pytest.raises(TypeError, match=r"moment2_method must be one of \['adamuon', 'normuon', 'namo'\], got 'adam'"):
        optim.AdaptiveMuon([p], 0.01, 0.9, 0.0, moment2_method="adam").step()
    with pytest.raises(ValueError, match=r"Muon only supports 2-D parameters .*\['params'\]\[1\] has shape \(6,\)"):
        optim.Muon([p, v]).step()
    with pytest.raises(TypeError, match=r"Muown only supports 2-D parameters"):
        optim.Muown([p, v]).step()
    with pytest.raises(ValueError, match=r"Only 2D parameters are supported: param_groups\[0\]\['params'\]\[1\]"):
        optim.MOP([p, v]).step()


def test_construction_checks_of_our_own_stay(gen):
    cube = torch.nn.Parameter(torch.randn(2, 4, 6, generator=gen))
    optim.Muon([cube], nd_mode="batch")  # routed at construction
    with pytest.raises(ValueError, match="nd_mode must be one of"):
        optim.Muon([cube], nd_mode="stacked")
    with pytest.raises(ValueError, match="cannot be viewed"):
        optim.Muon([torch.nn.Parameter(torch.randn(4, 3, 5).transpose(0, 1))], nd_mode="flatten")
    with pytest.raises(ValueError, match="num_ns_steps"):
        optim.Muon([cube], num_ns_steps=0)
    with pytest.raises(ValueError, match="namo"):
        optim.AdaptiveMuon([cube], 0.01, 0.9, 0.0, moment2_method="namo", weight_decay_method="l2")
    # HybridMuon routes its Muon groups at construction
    with pytest.raises(ValueError, match="2-D"):
        optim.HybridMuon([{"params": [cube], "use_muon": True}])


# ------------------------------------------------------------------ the family
def test_scion(gen):
    kwargs = dict(lr=0.05, momentum=0.9, fp32_matmul_prec="highest", spectral_radius=3.0)
    opt = _compare(optim.Scion, eo.scion.Scion, kwargs, gen)
    assert opt._use_fused_step()


def test_scion_default_precision(gen):
    _compare(optim.Scion, eo.scion.Scion, dict(lr=0.05), gen, shapes=[(48, 64)], tol=TOLERANCE["medium"])


@pytest.mark.parametrize("scale_mode", ["nuclear_norm", "spectral", "unit_rms_norm"])
def test_mop(scale_mode, gen):
    kwargs = dict(lr=0.01, weight_decay=0.1, scale_mode=scale_mode, extra_scale_factor=0.5)
    _compare(optim.MOP, eo.mop.MOP, kwargs, gen, shapes=[(9, 1), (97, 37), (24, 40), (16, 16)])


@pytest.mark.parametrize("num_ns_steps", [0, 5])
def test_polargrad(num_ns_steps, gen):
    kwargs = dict(lr=0.01, weight_decay=0.1, num_ns_steps=num_ns_steps, extra_scale_factor=0.5, nesterov=True)
    _compare(optim.PolarGrad, eo.polargrad.PolarGrad, kwargs, gen)


def test_polargrad_default_medium(gen):
    _compare(optim.PolarGrad, eo.polargrad.PolarGrad, dict(lr=0.01, fp32_matmul_prec="medium"), gen,
             shapes=[(48, 64)], tol=TOLERANCE["medium"])


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_spel(weight_decay, gen):
    kwargs = dict(lr=0.05, weight_decay=weight_decay, fp32_matmul_prec="highest")
    _compare(optim.Spel, eo.spel.Spel, kwargs, gen, shapes=[(24, 40), (40, 24), (16, 16), (97, 37)])


def _on_sphere(shapes, radius, gen):
    params = make_params(shapes, gen)
    with torch.no_grad():
        for p in params:
            p.mul_(radius / p.norm())
    return params


def test_muon_hyperball(gen):
    params = _on_sphere([(24, 40), (40, 24), (16, 16), (1, 9)], 2.5, gen)
    ref = clone_params(params)
    start = [p.detach().clone() for p in params]
    kwargs = dict(lr=0.05, weight_decay=0.1, fp32_matmul_prec="highest", hyperball_radius=2.5)
    opt = optim.MuonHyperball(params, **kwargs)
    theirs = eo.muon_hyperball.MuonHyperball(ref, **kwargs)
    assert opt._use_fused_step()  # the hook runs batched
    grads = make_grads(params, gen, STEPS)
    run_steps(opt, params, grads)
    run_steps(theirs, ref, grads)
    assert max_delta_err(params, ref, start) <= TOLERANCE["highest"]
    for p in params:
        assert abs(float(p.detach().norm()) - 2.5) <= 1e-5


def test_muon_hyperball_refusals(gen):
    with pytest.raises(ValueError, match="hyperball_radius=2.0 was specified"):
        optim.MuonHyperball(make_params([(4, 4)], gen), hyperball_radius=2.0)
    with pytest.raises(ValueError, match="non-zero norm"):
        optim.MuonHyperball([torch.nn.Parameter(torch.zeros(4, 4))], hyperball_radius=1.0)
    with pytest.raises(KeyError, match="weight_update_hook"):
        optim.MuonHyperball(_on_sphere([(4, 4)], 1.0, gen), hyperball_radius=1.0,
                            weight_update_hook=optim.RelativeUpdateHook())


def test_muown(gen):
    kwargs = dict(lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest", betas=(0.8, 0.9))
    shapes = [(24, 40), (24, 40), (40, 24), (16, 16), (9, 3)]
    _compare(optim.Muown, eo.muown.Muown, kwargs, gen, shapes=shapes,
             state_keys=("momentum_buffer", "g", "v_norm", "m_g", "v_g"))


# ------------------------------------------------------------------ weight-update hooks (EO main fd77292)
def _radial_brake_f64(outward, inward, eps):
    """EO main's RadialBrakeHook rule re-expressed in float64, as EO 0.4 pre/post overrides."""
    def pre(self, p, update):
        n = p.double().norm()
        self._pre_norm = n if n >= eps else n * 0

    def post(self, p):
        r0 = self._pre_norm
        r1 = p.double().norm()
        r1 = r1 if r1 >= eps else r1 * 0
        d = r1 - r0
        s = outward if d >= eps else (inward if d <= -eps else 0.0)
        target = r0 + s * d
        p.mul_(float(target / r1) if r1 >= eps else 0.0)

    return {"pre_weight_update_fn_inplace": pre, "post_weight_update_fn_inplace": post}


def _relative_update_f64(eps):
    def pre(self, p, update):
        w, u = p.double().norm(), update.double().norm()
        update.mul_(0.0 if (w < eps or u < eps) else float(w / u))

    return {"pre_weight_update_fn_inplace": pre}


def _hyperball_f64(radius, eps):
    def pre(self, p, update):
        n = update.double().norm()
        update.mul_(0.0 if n < eps else radius / float(n))

    def post(self, p):
        n = p.double().norm()
        p.mul_(0.0 if n < eps else radius / float(n))

    return {"pre_weight_update_fn_inplace": pre, "post_weight_update_fn_inplace": post}


@pytest.mark.parametrize("hook,reference", [
    (lambda: optim.RadialBrakeHook(outward_scale=0.3, inward_scale=0.8), lambda: _radial_brake_f64(0.3, 0.8, 1e-15)),
    (lambda: optim.RelativeUpdateHook(), lambda: _relative_update_f64(1e-15)),
    (lambda: optim.HyperballHook(radius=3.0), lambda: _hyperball_f64(3.0, 1e-15)),
], ids=["radial_brake", "relative_update", "hyperball"])
@pytest.mark.parametrize("wd_method", ["decoupled", "l2"])
@pytest.mark.parametrize("path", ["fused", "per_parameter"])
def test_weight_update_hooks(hook, reference, wd_method, path, gen):
    ours_cls = optim.Muon if path == "fused" else _eo_identity_override(optim.Muon, "post_weight_update_fn_inplace")
    theirs = type("EOHooked", (eo.muon.Muon,), reference())
    kwargs = dict(lr=0.05, weight_decay=0.1, weight_decay_method=wd_method, fp32_matmul_prec="highest")
    params = make_params(SHAPES, gen)
    ref = clone_params(params)
    start = [p.detach().clone() for p in params]
    opt = ours_cls(params, weight_update_hook=hook(), **kwargs)
    assert opt._use_fused_step() == (path == "fused")
    eo_opt = theirs(ref, **kwargs)
    grads = make_grads(params, gen, STEPS)
    run_steps(opt, params, grads)
    run_steps(eo_opt, ref, grads)
    assert max_delta_err(params, ref, start) <= TOLERANCE["highest"]


def test_custom_weight_update_hook_protocol(gen):
    calls = []

    class Recorder:
        def pre_weight_update_inplace(self, p, update):
            calls.append("pre")
            return p.detach().clone()

        def post_weight_update_inplace(self, p, before):
            calls.append("post")
            p.copy_(before + 0.5 * (p - before))  # keep half of every step

    params = make_params([(6, 10), (10, 6)], gen)
    ref = clone_params(params)
    start = [p.detach().clone() for p in params]
    # the hook sees the weight after decay (EO's order): keeping half of the update equals lr / 2
    opt = optim.Muon(params, lr=0.1, weight_decay=0.01, weight_update_hook=Recorder(), fp32_matmul_prec="highest")
    assert not opt._use_fused_step()
    plain = optim.Muon(ref, lr=0.05, weight_decay=0.02, fp32_matmul_prec="highest")
    grads = make_grads(params, gen, 1)
    run_steps(opt, params, grads)
    run_steps(plain, ref, grads)
    assert calls == ["pre", "post"] * 2
    assert max_delta_err(params, ref, start) <= TOLERANCE["highest"]


def test_hook_arguments_are_checked():
    with pytest.raises(ValueError, match="outward_scale"):
        optim.RadialBrakeHook(outward_scale=1.5)
    with pytest.raises(ValueError, match="radius"):
        optim.HyperballHook(radius=float("nan"))
    with pytest.raises(ValueError, match="eps"):
        optim.RelativeUpdateHook(eps=0.0)


# ------------------------------------------------------------------ functions
def test_newton_schulz_signature_and_defaults():
    ours = inspect.signature(me.newton_schulz).parameters
    ref = inspect.signature(eo.muon_utils.newton_schulz).parameters
    assert list(ours)[: len(ref)] == list(ref)
    for name in list(ref)[1:]:
        if ref[name].default is not inspect.Parameter.empty:
            assert ours[name].default == ref[name].default, name
        elif name == "steps":
            assert ours[name].default == 5  # ours keeps a default


@pytest.mark.parametrize("kwargs", [
    dict(steps=5), dict(steps=0), dict(steps=5, coefficient_type="cubic5"), dict(steps=3, normalize_in_double=True),
    dict(steps=0, normalize_in_double=True), dict(steps=6, coefficient_type="polar_express"),
])
@pytest.mark.parametrize("shape", [(97, 37), (2, 20, 30)])
def test_newton_schulz_options(kwargs, shape, gen):
    x = torch.randn(shape, generator=gen)
    tol = max(TOLERANCE["highest"], ns_tolerance(x, "highest", "cpu", kwargs.get("coefficient_type", "quintic")))
    assert rel_err(me.newton_schulz(x, **kwargs), eo.muon_utils.newton_schulz(x, **kwargs)) <= tol


def test_coefficient_iterator_matches(gen):
    rows = [tuple(torch.randn(3, generator=gen).tolist()) for _ in range(3)]
    for mode in ("cycle", "repeat_last"):
        assert list(me.get_coefficient_iterator(7, rows, mode)) == list(eo.muon_utils.get_coefficient_iterator(7, rows, mode))


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_spectral_clipping(shape, gen):
    x = torch.randn(shape, generator=gen) * 0.3
    for ours, theirs, kwargs in [
        (spectral_clipping.spectral_clip, eo.spectral_clipping_utils.spectral_clip, dict(sigma_min=-0.5, sigma_max=0.8)),
        (spectral_clipping.spectral_hardcap, eo.spectral_clipping_utils.spectral_hardcap, dict(beta=0.7)),
        (spectral_clipping.spectral_clipped_weight_decay, eo.spectral_clipping_utils.spectral_clipped_weight_decay,
         dict(beta=0.7, c=0.3)),
    ]:
        assert rel_err(ours(x, **kwargs), theirs(x, **kwargs)) <= 1e-4  # 16 chained fp32 NS runs


@pytest.mark.parametrize("center_rows", [False, True])
def test_one_sided_polargrad(center_rows, gen):
    tall, wide = torch.randn(40, 12, generator=gen), torch.randn(8, 30, generator=gen)
    kwargs = dict(alpha=0.5, center_rows=center_rows, extra_scale_factor=2.0)
    assert rel_err(right_polargrad_orth_fn(tall, **kwargs), eo.polargrad.right_polargrad_orth_fn(tall, **kwargs)) <= 1e-5
    assert rel_err(left_polargrad_orth_fn(wide, **kwargs), eo.polargrad.left_polargrad_orth_fn(wide, **kwargs)) <= 1e-5


# ------------------------------------------------------------------ registry
def test_eo_registry_functions(gen):
    for name in ("muon", "adaptive_muon", "scion", "mop", "muon_hyperball", "polargrad", "spel"):
        assert registry.get_optimizer_cls(name).__name__ == eo.registry.get_optimizer_cls(name).__name__
    assert registry.get_optimizer_cls("Muon") is optim.Muon
    family = {"muon", "adaptive_muon", "scion", "mop", "muon_hyperball", "polargrad", "spel"}
    assert family <= set(eo.registry.get_optimizer_name_list()) and family <= set(registry.get_optimizer_name_list())
    make = registry.get_configured_optimizer_cls("scion", lr=0.1, spectral_radius=2.0)
    opt = make(make_params([(4, 6)], gen))
    assert isinstance(opt, optim.Scion) and opt.param_groups[0]["lr"] == 0.1
    with pytest.raises(TypeError, match="does not accept arguments"):
        registry.validate_optimizer_args(optim.Scion, {"weight_decay": 0.1})
    with pytest.raises(ValueError, match="not found in the registry"):
        registry.get_optimizer_cls("adamw_nonexistent")


# ------------------------------------------------------------------ torch.compile of the fused family steps
@pytest.mark.parametrize("cls_name", ["Scion", "MuonHyperball"])
def test_fused_family_steps_compile_without_graph_breaks(cls_name, gen):
    kwargs = dict(lr=0.05, fp32_matmul_prec="highest")
    if cls_name == "MuonHyperball":
        kwargs["hyperball_radius"] = 1.0
    params = _on_sphere([(8, 12), (12, 8)], 1.0, gen)
    ref = clone_params(params)
    compiled = getattr(optim, cls_name)(params, **kwargs)
    eager = getattr(optim, cls_name)(ref, **kwargs)
    step = torch.compile(compiled.step, fullgraph=True)
    for grads in make_grads(params, gen, 2):
        for p, r, g in zip(params, ref, grads):
            p.grad, r.grad = g.clone(), g.clone()
        step()
        eager.step()
    for p, r in zip(params, ref):
        assert rel_err(p.detach(), r.detach()) <= 1e-6
