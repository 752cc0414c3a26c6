"""What drop-in users of Emerging-Optimizers / torch.optim meet: warm-up schedules under
torch.compile, GradScaler, step-time checks of scheduler-written values, non-contiguous params,
swapped params and the orthogonalize() extension point."""

import pickle

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_eopt.optim import AdaptiveMuon, Muon
from optim_helpers import ReferenceMuon, clone_params, make_grads, make_params, max_delta_err, run_steps
from reference import TOLERANCE

SHAPES = [(8, 12), (12, 8), (1, 5), (7, 3)]
CASES = {
    "muon": lambda ps, **kw: Muon(ps, lr=0.02, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest", **kw),
    "adamuon": lambda ps, **kw: AdaptiveMuon(ps, 0.02, 0.9, 0.1, moment2_method="adamuon", fp32_matmul_prec="highest",
                                             **kw),
    "normuon": lambda ps, **kw: AdaptiveMuon(ps, 0.02, 0.9, 0.1, moment2_method="normuon", fp32_matmul_prec="highest",
                                             **kw),
    "namo": lambda ps, **kw: AdaptiveMuon(ps, 0.02, 0.9, 0.1, moment2_method="namo", fp32_matmul_prec="highest",
                                          **kw),
}


def _snapshot(opt, params):
    return [p.detach().clone() for p in params] + [
        v.clone() for p in params for v in opt.state[p].values() if isinstance(v, torch.Tensor)
    ]


# ------------------------------------------------------------------ warm-up schedules, compiled
@pytest.mark.parametrize("case", ["muon", "normuon"])
@pytest.mark.parametrize("kind", ["float", "tensor"])
def test_compiled_step_follows_a_momentum_and_beta2_schedule(case, kind, gen):
    # nanochat / modded-nanogpt write group["momentum"] every step (a float, or a tensor in place).
    torch._dynamo.reset()
    counters.clear()
    params = make_params(SHAPES, gen, scale=0.1)
    eager_params = clone_params(params)
    start = [p.detach().clone() for p in params]
    opt, eager = CASES[case](params), CASES[case](eager_params)
    group = opt.param_groups[0]
    keys = ["momentum"] + (["beta2"] if case != "muon" else [])
    if kind == "tensor":
        for k in keys:
            group[k] = torch.tensor(group[k], dtype=torch.float64)
    opt.init_state()
    step = torch.compile(opt.step, fullgraph=True)
    schedule = [0.85, 0.88, 0.91, 0.94, 0.95]
    graphs = []
    for t, grads in enumerate(make_grads(params, gen, len(schedule))):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for k in keys:
            if kind == "tensor":
                group[k].fill_(schedule[t])
            else:
                group[k] = schedule[t]
            eager.param_groups[0][k] = schedule[t]
        step()
        graphs.append(counters["stats"]["unique_graphs"])
        run_steps(eager, eager_params, [grads])
    if kind == "tensor":
        assert graphs == [1] * len(schedule), graphs
    else:  # dynamo makes a changed float a graph input once, then never recompiles for it
        assert graphs[-1] == graphs[1] <= 2, graphs
    assert max_delta_err(params, eager_params, start) <= TOLERANCE["highest"]


# ------------------------------------------------------------------ GradScaler
class _Model(torch.nn.Module):
    def __init__(self, gen):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(12, 8, generator=gen) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(5, 12, generator=gen) * 0.1)

    def forward(self, x):
        return torch.tanh(x @ self.a.t()) @ self.b.t()


@pytest.mark.parametrize("case", ["muon", "adamuon", "normuon", "namo"])
@pytest.mark.parametrize("unscale_first", [False, True])
def test_grad_scaler_unscales_inside_the_step(case, unscale_first, gen):
    # Same result as stepping on the true gradients; with unscale_ called first (for clipping)
    # GradScaler hands no grad_scale and the step only reads found_inf.
    model = _Model(gen)
    ref_model = _Model(gen)
    ref_model.load_state_dict(model.state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    opt, ref = CASES[case](list(model.parameters())), CASES[case](list(ref_model.parameters()))
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad()
        scaler.scale(model(x).square().sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        ref.zero_grad()
        ref_model(x).square().sum().backward()
        ref.step()
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    assert max_delta_err(list(model.parameters()), list(ref_model.parameters()), start) <= TOLERANCE["highest"]


@pytest.mark.parametrize("case", ["muon", "adamuon", "normuon", "namo"])
def test_grad_scaler_overflow_skips_the_whole_step(case, gen):
    model = _Model(gen)
    opt = CASES[case](list(model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(4, 8, generator=gen)
    scaler.scale(model(x).square().sum()).backward()
    scaler.step(opt)  # one good step: state exists and is non-zero
    scaler.update()
    before = _snapshot(opt, list(model.parameters()))
    opt.zero_grad()
    scaler.scale(model(x).square().sum()).backward()
    model.a.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    after = _snapshot(opt, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert scaler.get_scale() == 512.0


# ------------------------------------------------------------------ scheduler-written values
@pytest.mark.parametrize("key,value", [("lr", float("nan")), ("lr", float("inf")), ("weight_decay", float("nan")),
                                       ("lr", torch.tensor(float("nan"))), ("momentum", 1.0),
                                       ("weight_decay", -1.0)])
def test_bad_step_values_raise_before_anything_changes(key, value, gen):
    params = make_params(SHAPES, gen)
    opt = CASES["muon"](params)
    run_steps(opt, params, make_grads(params, gen, 1))
    before = _snapshot(opt, params)
    opt.param_groups[0][key] = value
    for p, g in zip(params, make_grads(params, gen, 1)[0]):
        p.grad = g
    with pytest.raises(ValueError, match=f"param_groups\\[0\\]\\['{key}'\\] must be"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt, params)))


@pytest.mark.parametrize("eps", [1e-46, 1e39])
def test_eps_is_checked_in_float32(eps, gen):
    params = make_params(SHAPES, gen)
    opt = CASES["adamuon"](params)
    opt.param_groups[0]["eps"] = eps
    for p, g in zip(params, make_grads(params, gen, 1)[0]):
        p.grad = g
    with pytest.raises(ValueError, match="eps'\\] must be finite and positive in float32"):
        opt.step()


# ------------------------------------------------------------------ layouts and param edits
@pytest.mark.parametrize("case", ["muon", "normuon"])
def test_transposed_param_steps_like_a_contiguous_one(case, gen):
    base = torch.randn(12, 8, generator=gen) * 0.1
    p_t = torch.nn.Parameter(base.t().contiguous().t())  # (12, 8) with strides (1, 12)
    p_c = torch.nn.Parameter(base.clone())
    assert not p_t.is_contiguous()
    opt, ref = CASES[case]([p_t]), CASES[case]([p_c])
    for grads in make_grads([p_c], gen, 3):
        p_t.grad, p_c.grad = grads[0].clone(), grads[0].clone()
        opt.step()
        ref.step()
    assert torch.equal(p_t, p_c) and p_t.stride() == (1, 12)
    assert torch.equal(opt.state[p_t]["momentum_buffer"], ref.state[p_c]["momentum_buffer"])


def test_swapped_param_rebuilds_the_plan(gen):
    params = make_params(SHAPES, gen, scale=0.1)
    opt = CASES["muon"](params)
    run_steps(opt, params, make_grads(params, gen, 1))
    new = torch.nn.Parameter(torch.randn(6, 6, generator=gen) * 0.1)
    opt.param_groups[0]["params"][2] = new  # same count, different tensor and shape
    params[2] = new
    fresh = clone_params(params)
    ref = ReferenceMuon(fresh, lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True)
    start = new.detach().clone()
    grads = make_grads(params, gen, 1)[0]
    run_steps(opt, params, [grads])
    ref.step(grads)
    assert "momentum_buffer" in opt.state[new]
    assert max_delta_err([new], [ref.params[2]], [start]) <= TOLERANCE["highest"]


# ------------------------------------------------------------------ orthogonalize(): EO's extension point
def test_orthogonalize_returns_the_scaled_update(gen):
    p = torch.nn.Parameter(torch.randn(12, 8, generator=gen))
    opt = CASES["muon"]([p])
    g = torch.randn(12, 8, generator=gen)
    ref = ReferenceMuon([p], lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True)
    want, scale = ref._orth_parts(0, g.double())
    got = opt.orthogonalize(p, g, **opt.param_groups[0])
    assert got.shape == (12, 8) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want * scale, rtol=0, atol=2e-5)
    ada = CASES["normuon"]([p])
    torch.testing.assert_close(ada.orthogonalize(p, g).double(), want, rtol=0, atol=2e-5)  # raw NS output


class _SignMuon(Muon):
    """A subclass as Megatron-LM / EO users write them: custom handling for some params only."""

    def __init__(self, params, special, **kw):
        super().__init__(params, **kw)
        self.special = special
        self.calls = []

    def orthogonalize(self, p, grad, **kwargs):
        self.calls.append((p.shape, kwargs["lr"]))
        if p is self.special:
            return torch.sign(grad) * 0.5
        return super().orthogonalize(p, grad, **kwargs)


def test_step_calls_an_orthogonalize_override(gen):
    params = make_params(SHAPES, gen, scale=0.1)
    kw = dict(lr=0.02, momentum=0.9, weight_decay=0.0, nesterov=False, fp32_matmul_prec="highest")
    opt = _SignMuon(params, params[1], **kw)
    plain_params = clone_params(params)
    plain = Muon(plain_params, **kw)
    start = [p.detach().clone() for p in params]
    grads = make_grads(params, gen, 1)[0]
    run_steps(opt, params, [grads])
    run_steps(plain, plain_params, [grads])
    assert len(opt.calls) == len(params) and opt.calls[0][1] == 0.02
    # The overridden param: p -= lr * sign(momentum) * 0.5 (first step: momentum = (1 - mu) g).
    torch.testing.assert_close(params[1].detach(), start[1] - 0.02 * 0.5 * torch.sign(grads[1]))
    # The others: the fused batched path, bitwise what the plain optimizer computes.
    for i in (0, 2, 3):
        assert torch.equal(params[i], plain_params[i])


def test_orthogonalize_override_must_return_the_param_shape(gen):
    class Bad(Muon):
        def orthogonalize(self, p, grad, **kwargs):
            return grad.t()

    params = make_params([(8, 12)], gen)
    opt = Bad(params, lr=0.02)
    before = params[0].detach().clone()
    params[0].grad = torch.randn(8, 12, generator=gen)
    with pytest.raises(ValueError, match="must return a tensor of shape \\(8, 12\\)"):
        opt.step()
    assert torch.equal(params[0], before)


# ------------------------------------------------------------------ fp32_matmul_prec: one setting
def _fused_classes():
    from megatron_eopt.optim import (MOP, MuonHyperball, Muown, PolarGrad, Scion, Spel, TensorParallelAdaptiveMuon,
                                     TensorParallelMuon)
    from megatron_eopt.torch_optim import Muon as TorchOptimMuon

    return {
        "muon": lambda ps: Muon(ps, lr=0.02, fp32_matmul_prec="high"),
        "adaptive": lambda ps: AdaptiveMuon(ps, 0.02, 0.9, 0.0, moment2_method="normuon", fp32_matmul_prec="high"),
        "tp_muon": lambda ps: TensorParallelMuon(ps, lr=0.02, fp32_matmul_prec="high"),
        "tp_adaptive": lambda ps: TensorParallelAdaptiveMuon(ps, 0.02, 0.9, 0.0, moment2_method="adamuon",
                                                             fp32_matmul_prec="high"),
        "scion": lambda ps: Scion(ps, lr=0.02, fp32_matmul_prec="high"),
        "muown": lambda ps: Muown(ps, lr=0.02, fp32_matmul_prec="high"),
        "hyperball": lambda ps: MuonHyperball(ps, lr=0.02, hyperball_radius=1.0, fp32_matmul_prec="high"),
        "mop": lambda ps: MOP(ps, lr=0.02, fp32_matmul_prec="high"),
        "polargrad": lambda ps: PolarGrad(ps, lr=0.02, fp32_matmul_prec="high"),
        "spel": lambda ps: Spel(ps, lr=0.02, fp32_matmul_prec="high"),
        "torch_optim": lambda ps: TorchOptimMuon(ps, lr=0.02),
    }


@pytest.mark.parametrize("name", sorted(_fused_classes()))
def test_fp32_matmul_prec_is_one_setting_the_fused_step_follows(name, gen):
    build = _fused_classes()[name]
    params = make_params([(8, 12), (12, 8)], gen)
    with torch.no_grad():  # on the unit sphere, for MuonHyperball
        for p in params:
            p.div_(p.norm())
    opt = build(params)
    if opt._config is not None:
        assert opt._config.precision == opt.fp32_matmul_prec
    opt.fp32_matmul_prec = "highest"
    assert opt.fp32_matmul_prec == "highest"
    assert opt._config is None or all(c.precision == "highest" for c in opt._group_configs())


def test_setting_fp32_matmul_prec_steps_like_constructing_with_it(gen):
    params = make_params([(8, 12), (12, 8), (8, 12)], gen)
    grads = make_grads(params, gen, 3)
    changed, built = clone_params(params), clone_params(params)
    opt = Muon(changed, lr=0.02)
    run_steps(opt, changed, grads[:1])
    opt.fp32_matmul_prec = "highest"
    run_steps(opt, changed, grads[1:])
    ref = Muon(built, lr=0.02)
    run_steps(ref, built, grads[:1])
    ref_high = Muon(built, lr=0.02, fp32_matmul_prec="highest")
    ref_high.load_state_dict(ref.state_dict())
    run_steps(ref_high, built, grads[1:])
    for p, q in zip(changed, built):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_bad_fp32_matmul_prec_is_refused_naming_it_and_changes_nothing(gen):
    opt = Muon(make_params([(8, 12)], gen), lr=0.02)
    with pytest.raises(ValueError, match="fp32_matmul_prec"):
        opt.fp32_matmul_prec = "low"
    assert opt.fp32_matmul_prec == "medium" and opt._config.precision == "medium"


# Every setting Emerging-Optimizers keeps as an attribute has one home, the fused configuration.
SETTINGS = ("nesterov", "weight_decay_method", "fp32_matmul_prec", "scale_mode", "extra_scale_factor",
            "moment2_method")
CONFIG_FIELD = dict(fp32_matmul_prec="precision")


@pytest.mark.parametrize("name", ["muon", "adaptive", "tp_muon", "tp_adaptive", "scion"])
def test_settings_are_read_from_the_configuration_with_no_second_copy(name, gen):
    opt = _fused_classes()[name](make_params([(8, 12)], gen))
    for setting in SETTINGS:
        assert getattr(opt, setting) == getattr(opt._config, CONFIG_FIELD.get(setting, setting)), setting
        assert setting not in opt.__dict__ and "_" + setting not in opt.__dict__, setting


@pytest.mark.parametrize("setting, value", [("nesterov", True), ("weight_decay_method", "independent"),
                                            ("scale_mode", "unit_rms_norm"), ("extra_scale_factor", 0.5)])
def test_setting_an_attribute_steps_like_constructing_with_it(setting, value, gen):
    # EO reads these attributes at every step: a value set between steps applies to the next one
    params = make_params([(8, 12), (12, 8), (8, 12)], gen)
    grads = make_grads(params, gen, 3)
    changed, built = clone_params(params), clone_params(params)
    opt = Muon(changed, lr=0.02, weight_decay=0.1)
    run_steps(opt, changed, grads[:1])
    setattr(opt, setting, value)
    assert getattr(opt, setting) == value
    run_steps(opt, changed, grads[1:])
    ref = Muon(built, lr=0.02, weight_decay=0.1)
    run_steps(ref, built, grads[:1])
    ref_set = Muon(built, lr=0.02, weight_decay=0.1, **{setting: value})
    ref_set.load_state_dict(ref.state_dict())
    run_steps(ref_set, built, grads[1:])
    for p, q in zip(changed, built):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert not torch.equal(changed[0], clone_params(params)[0])


@pytest.mark.parametrize("setting, value", [("weight_decay_method", "sideways"), ("scale_mode", "huge"),
                                            ("extra_scale_factor", float("nan"))])
def test_a_bad_setting_is_refused_naming_it_and_changes_nothing(setting, value, gen):
    opt = Muon(make_params([(8, 12)], gen), lr=0.02)
    config = opt._config
    with pytest.raises(ValueError, match=setting):
        setattr(opt, setting, value)
    assert opt._config is config


def test_an_eo_style_optimizer_refuses_a_bad_fp32_matmul_prec_at_construction(gen):
    from megatron_eopt.optim import OrthogonalizedOptimizer

    params = make_params([(8, 12)], gen)
    with pytest.raises(ValueError, match="fp32_matmul_prec"):
        OrthogonalizedOptimizer(params, 0.02, 0.9, 0.0, nesterov=False, weight_decay_method="decoupled",
                                fp32_matmul_prec="low")
    opt = OrthogonalizedOptimizer(params, 0.02, 0.9, 0.0, nesterov=1, weight_decay_method="sideways",
                                  fp32_matmul_prec="high")
    assert opt.weight_decay_method == "sideways"  # EO takes it as given; its step refuses it
    with pytest.raises(ValueError, match="fp32_matmul_prec"):
        opt.fp32_matmul_prec = "low"


def test_nesterov_is_stored_as_a_bool(gen):
    opt = Muon(make_params([(8, 12)], gen), lr=0.02)
    opt.nesterov = 1
    assert opt.nesterov is True and opt._config.nesterov is True


def test_moment2_method_is_fixed_at_construction(gen):
    opt = AdaptiveMuon(make_params([(8, 12)], gen), 0.02, 0.9, 0.0, moment2_method="normuon")
    opt.moment2_method = "normuon"  # the same value: nothing to change
    with pytest.raises(AttributeError, match="moment2_method is fixed"):
        opt.moment2_method = "adamuon"
    assert opt.moment2_method == "normuon"


def test_settings_survive_a_pickle_round_trip(gen):
    opt = Muon(make_params([(8, 12)], gen), lr=0.02)
    opt.nesterov = True
    copied = pickle.loads(pickle.dumps(opt))
    assert copied.nesterov is True and copied._config.nesterov is True
    assert "_nesterov" not in copied.__dict__


def test_muon_read_only_properties_and_subscript():
    """Emerging-Optimizers main's Muon: read-only num_ns_steps, coefficient_type, use_syrk (assigning,
    even the same value, is an AttributeError); Muon[...] subscripts the generic class and builds a
    Muon; the properties survive a copy. Megatron-FSDP's FsdpMuon reads inner.num_ns_steps."""
    import copy

    from megatron_eopt.optim import Muon, MuonHyperball

    params = [torch.nn.Parameter(torch.randn(6, 4))]
    opt = Muon(params, num_ns_steps=7, coefficient_type="polar_express", use_syrk=True)
    assert (opt.num_ns_steps, opt.coefficient_type, opt.use_syrk) == (7, "polar_express", True)
    plain = Muon[None](params)
    assert type(plain) is Muon and (plain.num_ns_steps, plain.coefficient_type, plain.use_syrk) == (5, "quintic", False)
    for name in ("num_ns_steps", "coefficient_type", "use_syrk"):
        with pytest.raises(AttributeError, match=f"Cannot set `{name}` post-initialization"):
            setattr(opt, name, getattr(opt, name))
    assert (opt.num_ns_steps, opt.coefficient_type) == (7, "polar_express")
    clone = copy.deepcopy(opt)
    assert (clone.num_ns_steps, clone.coefficient_type, clone.use_syrk) == (7, "polar_express", True)
    assert Muon[dict].__origin__ is Muon and Muon[dict].__args__ == (dict,)
    with pytest.raises(TypeError, match="Too many arguments"):
        Muon[int, str]
    sphere = [torch.nn.Parameter(torch.nn.functional.normalize(torch.randn(6, 4), dim=(0, 1)))]
    hyperball = MuonHyperball(sphere, hyperball_radius=1.0, num_ns_steps=3)
    assert hyperball.num_ns_steps == 3
