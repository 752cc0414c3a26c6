"""State, state_dict interop with Emerging-Optimizers, param groups, schedulers and bad input."""

import pytest
import torch

from megatron_eopt.optim import AdaptiveMuon, Muon, TensorParallelAdaptiveMuon, TensorParallelMuon
from optim_helpers import SHAPES, clone_params, continued_delta_err, make_grads
from optim_helpers import make_params, max_delta_err, run_steps
from reference import TOLERANCE

eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers")

HIGHEST = TOLERANCE["highest"]
ADAPTIVE = dict(lr=0.02, momentum=0.9, weight_decay=0.1, beta2=0.9, fp32_matmul_prec="highest")
CASES = {
    "muon": (Muon, eo.Muon, dict(lr=0.02, nesterov=True, fp32_matmul_prec="highest")),
    "adamuon": (AdaptiveMuon, eo.AdaptiveMuon, dict(ADAPTIVE, moment2_method="adamuon")),
    "normuon": (AdaptiveMuon, eo.AdaptiveMuon, dict(ADAPTIVE, moment2_method="normuon")),
    "namo": (AdaptiveMuon, eo.AdaptiveMuon, dict(ADAPTIVE, moment2_method="namo")),
}


def _tolerance(case):
    return TOLERANCE["high"] if case == "adamuon" else HIGHEST  # see test_optim_muon_parity


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("direction", ["ours_to_eo", "eo_to_ours"])
def test_state_dict_round_trip_with_emerging_optimizers(case, direction, gen):
    ours_cls, eo_cls, kwargs = CASES[case]
    first_cls, second_cls = (ours_cls, eo_cls) if direction == "ours_to_eo" else (eo_cls, ours_cls)
    params = make_params(SHAPES, gen, scale=0.1)
    grads = make_grads(params, gen, 5)
    straight = clone_params(params)
    straight_opt = second_cls(straight, **kwargs)
    run_steps(straight_opt, straight, grads[:2])
    first = first_cls(params, **kwargs)
    run_steps(first, params, grads[:2])
    saved = first.state_dict()
    second = second_cls(params, **kwargs)
    second.load_state_dict(saved)
    for p, r in zip(params, straight):
        assert sorted(second.state[p]) == sorted(straight_opt.state[r])
        for key, value in second.state[p].items():
            assert value.shape == straight_opt.state[r][key].shape
    assert continued_delta_err(second, params, straight_opt, straight, grads[2:]) <= _tolerance(case)


@pytest.mark.parametrize("case", list(CASES))
def test_init_state_layout_matches_reference_for_params_without_grads(case, gen):
    ours_cls, eo_cls, kwargs = CASES[case]
    params = make_params(SHAPES, gen)
    ours = ours_cls(params, **kwargs)
    ref = eo_cls(clone_params(params), **kwargs)
    ours.init_state()
    for group in ref.param_groups:
        ref._init_group(group, skip_non_grad_params=False)
    assert len(ours.state) == len(params)
    for p, r in zip(ours.param_groups[0]["params"], ref.param_groups[0]["params"]):
        assert set(ours.state[p]) == set(ref.state[r])
        for key in ref.state[r]:
            a, b = ours.state[p][key], ref.state[r][key]
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device) and not a.any()
    # Megatron's init_state_fn calls _init_group(group, skip_non_grad_params=False) directly.
    fresh = ours_cls(clone_params(params), **kwargs)
    for group in fresh.param_groups:
        fresh._init_group(group, skip_non_grad_params=False)
    assert len(fresh.state) == len(params)


def test_state_is_lazy_and_params_without_grad_are_untouched(gen):
    params = make_params(SHAPES, gen)
    before = [p.detach().clone() for p in params]
    opt = Muon(params, lr=0.02)
    grads = make_grads(params, gen, 2, skip={1, 4})
    run_steps(opt, params, grads)
    for i, (p, b) in enumerate(zip(params, before)):
        if i in (1, 4):
            assert p not in opt.state and torch.equal(p, b)
        else:
            assert set(opt.state[p]) == {"momentum_buffer"} and not torch.equal(p, b)


def test_grads_appearing_and_disappearing_between_steps(gen):
    params = make_params(SHAPES, gen, scale=0.1)
    ref_params = clone_params(params)
    start = [p.detach().clone() for p in params]
    grads = make_grads(params, gen, 1, skip={0, 2}) + make_grads(params, gen, 1) + make_grads(params, gen, 1, skip={3})
    kwargs = dict(lr=0.02, fp32_matmul_prec="highest")
    ours, ref = Muon(params, **kwargs), eo.Muon(ref_params, **kwargs)
    run_steps(ours, params, grads)
    run_steps(ref, ref_params, grads)
    assert max_delta_err(params, ref_params, start) <= HIGHEST


def test_param_groups_schedulers_and_extra_keys(gen):
    # Two groups with their own lr / weight decay and an extra key, a LambdaLR scheduler writing
    # floats, and an empty group: the same trajectory as the reference.
    params = make_params(SHAPES, gen, scale=0.1)
    ref_params = clone_params(params)
    start = [p.detach().clone() for p in params]

    def groups(ps):
        return [
            {"params": ps[:3], "lr": 0.05, "weight_decay": 0.2, "tag": "attn"},
            {"params": []},
            {"params": ps[3:], "wd_mult": 0.5},
        ]

    kwargs = dict(lr=0.02, weight_decay=0.1, fp32_matmul_prec="highest")
    ours, ref = Muon(groups(params), **kwargs), eo.Muon(groups(ref_params), **kwargs)
    assert ours.param_groups[0]["tag"] == "attn" and ours.param_groups[2]["wd_mult"] == 0.5
    lam = lambda step: 1.0 / (1 + step)  # noqa: E731
    sched, ref_sched = torch.optim.lr_scheduler.LambdaLR(ours, lam), torch.optim.lr_scheduler.LambdaLR(ref, lam)
    for grads in make_grads(params, gen, 4):
        run_steps(ours, params, [grads])
        run_steps(ref, ref_params, [grads])
        sched.step()
        ref_sched.step()
    assert max_delta_err(params, ref_params, start) <= HIGHEST
    assert ours.state_dict()["param_groups"][0]["tag"] == "attn"


def test_tensor_lr_and_weight_decay(gen):
    params = make_params(SHAPES, gen, scale=0.1)
    ref_params = clone_params(params)
    start = [p.detach().clone() for p in params]
    ours = Muon(params, lr=torch.tensor(0.03), weight_decay=torch.tensor(0.1), fp32_matmul_prec="highest")
    ref = eo.Muon(ref_params, lr=0.03, weight_decay=0.1, fp32_matmul_prec="highest")
    for t, grads in enumerate(make_grads(params, gen, 3)):
        ours.param_groups[0]["lr"].fill_(0.03 / (t + 1))  # in place, as LRScheduler does for tensor lrs
        ref.param_groups[0]["lr"] = 0.03 / (t + 1)
        run_steps(ours, params, [grads])
        run_steps(ref, ref_params, [grads])
    assert max_delta_err(params, ref_params, start) <= HIGHEST


def test_add_param_group_regroups(gen):
    params = make_params(SHAPES, gen, scale=0.1)
    ref_params = clone_params(params)
    start = [p.detach().clone() for p in params]
    kwargs = dict(lr=0.02, fp32_matmul_prec="highest")
    ours, ref = Muon(params[:4], **kwargs), eo.Muon(ref_params[:4], **kwargs)
    grads = make_grads(params, gen, 3)
    for t, g in enumerate(grads):
        if t == 1:
            ours.add_param_group({"params": params[4:], "lr": 0.01})
            ref.add_param_group({"params": ref_params[4:], "lr": 0.01})
        n = 4 if t == 0 else len(params)
        run_steps(ours, params[:n], [g[:n]])
        run_steps(ref, ref_params[:n], [g[:n]])
    assert max_delta_err(params, ref_params, start) <= HIGHEST


@pytest.mark.parametrize("cls", [Muon, AdaptiveMuon, TensorParallelMuon, TensorParallelAdaptiveMuon])
def test_closure_is_rejected_like_the_reference(cls, gen):
    params = make_params([(4, 6)], gen)
    kwargs = dict(lr=0.1, momentum=0.9, weight_decay=0.0)
    opt = cls(params, **kwargs)
    params[0].grad = torch.randn(4, 6, generator=gen)
    before = params[0].detach().clone()
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    assert torch.equal(params[0], before) and len(opt.state) == 0
    with pytest.raises(ValueError, match="closure"):
        eo.Muon(clone_params(params)).step(lambda: 0.0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fp32_matmul_prec="low"), "fp32_matmul_prec"),
        (dict(num_ns_steps=0), "num_ns_steps"),
        (dict(lr=-0.1), "lr"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(momentum=1.5), "momentum"),
        (dict(lr=float("nan")), "lr"),
    ],
)
def test_muon_rejects_bad_arguments(kwargs, match, gen):
    with pytest.raises(ValueError, match=match):
        Muon(make_params([(4, 6)], gen), **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(moment2_method="namo", weight_decay_method="l2"), "namo"),
        (dict(beta2=1.0), "beta2"),
        (dict(eps=0.0), "eps"),
    ],
)
def test_adaptive_muon_rejects_bad_arguments(kwargs, match, gen):
    with pytest.raises(ValueError, match=match):
        AdaptiveMuon(make_params([(4, 6)], gen), 0.01, 0.9, 0.0, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tp_mode="sharded"), "tp_mode"),
        (dict(split_qkv=True), "is_qkv_fn"),
        (dict(split_qkv=True, is_qkv_fn=lambda p: True), "qkv_split_shapes"),
        (dict(split_qkv=True, is_qkv_fn=lambda p: True, qkv_split_shapes=[2, 1, 1]), "multiple"),
        (dict(moment2_method="namo", use_decoupled_weight_decay=False), "namo"),
    ],
)
def test_tensor_parallel_rejects_bad_arguments(kwargs, match, gen):
    cls = TensorParallelAdaptiveMuon if "moment2_method" in kwargs else TensorParallelMuon
    with pytest.raises(ValueError, match=match):
        cls(make_params([(6, 6)], gen), **kwargs)


# Emerging-Optimizers 0.4 accepts these at construction and raises when step() first uses them.
STEP_TIME_ARGUMENTS = [
    (Muon, dict(weight_decay_method="l1"), ValueError, "weight_decay_method must be one of .* got 'l1'"),
    (Muon, dict(coefficient_type="cubic"), ValueError, "coefficient_type"),
    (Muon, dict(coefficient_type="custom"), ValueError, "custom_coefficient_sets"),
    (Muon, dict(scale_mode="rms"), ValueError, "scale_mode must be one of .* got 'rms'"),
    (AdaptiveMuon, dict(moment2_method="adam"), TypeError, "moment2_method must be one of .* got 'adam'"),
    (AdaptiveMuon, dict(scale_mode="rms"), ValueError, "scale_mode"),
]


@pytest.mark.parametrize("cls,kwargs,exc,match", STEP_TIME_ARGUMENTS, ids=lambda v: str(v)[:24])
def test_bad_step_time_arguments_raise_at_step_and_change_nothing(cls, kwargs, exc, match, gen):
    params = make_params(SHAPES, gen)
    args = (0.01, 0.9, 0.1) if cls is AdaptiveMuon else ()
    opt = cls(params, *args, **kwargs)  # accepted, as in EO
    opt.step()  # no gradient: nothing uses them yet
    for p, g in zip(params, make_grads(params, gen, 1)[0]):
        p.grad = g
    snapshot = _snapshot(opt, params)
    with pytest.raises(exc, match=match):
        opt.step()
    _assert_unchanged(opt, params, snapshot)
    assert not opt.state


def test_unknown_moment2_method_refuses_to_create_state(gen):
    params = make_params([(4, 6)], gen)
    opt = AdaptiveMuon(params, 0.01, 0.9, 0.0, moment2_method="adam")
    with pytest.raises(TypeError, match="moment2_method"):
        opt.init_state()
    assert not opt.state


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4), ()])
def test_non_matrix_params_are_refused_at_step(shape, gen):
    good = make_params([(4, 6)], gen)
    bad = torch.nn.Parameter(torch.randn(shape, generator=gen))
    opt = Muon(good + [bad])  # accepted at construction, as in EO
    good[0].grad = torch.randn(4, 6, generator=gen)
    opt.step()  # the non-matrix has no gradient: EO's Muon skips it too
    bad.grad = torch.randn_like(bad)
    snapshot = _snapshot(opt, good + [bad])
    with pytest.raises(ValueError, match=r"2-D parameters.*param_groups\[0\]\['params'\]\[1\] has shape"):
        opt.step()
    _assert_unchanged(opt, good + [bad], snapshot)
    opt = Muon(good)
    opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 2
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\]"):
        opt.step()
    opt.param_groups.pop()
    opt.step()  # usable again without it
    # AdaptiveMuon checks every param, with or without a gradient (EO's order); TensorParallelMuon
    # (Megatron-LM's) still refuses at construction.
    bad.grad = None
    with pytest.raises(ValueError, match="2-D"):
        AdaptiveMuon(good + [bad], 0.01, 0.9, 0.0).step()
    with pytest.raises(ValueError, match="2-D"):
        TensorParallelMuon(good + [bad])


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], {
        id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params if p in opt.state
    }


def _assert_unchanged(opt, params, snapshot):
    values, state = snapshot
    for p, v in zip(params, values):
        assert torch.equal(p, v)
    assert {id(p) for p in params if p in opt.state and opt.state[p]} == set(state)
    for p in params:
        for k, v in state.get(id(p), {}).items():
            assert torch.equal(opt.state[p][k], v)


@pytest.mark.parametrize("problem", ["negative_lr", "negative_weight_decay", "grad_dtype", "sparse"])
def test_bad_input_at_step_mutates_nothing(problem, gen):
    params = make_params(SHAPES, gen)
    opt = AdaptiveMuon(params, 0.02, 0.9, 0.1, moment2_method="normuon")
    run_steps(opt, params, make_grads(params, gen, 1))
    for p, g in zip(params, make_grads(params, gen, 1)[0]):
        p.grad = g
    snapshot = _snapshot(opt, params)
    if problem == "negative_lr":
        opt.param_groups[0]["lr"] = -1.0
    elif problem == "negative_weight_decay":
        opt.param_groups[0]["weight_decay"] = -0.5
    elif problem == "grad_dtype":
        params[-1].grad_dtype = None  # lets autograd accept a grad of another dtype (torch >= 2.14)
        try:
            params[-1].grad = params[-1].grad.double()
        except RuntimeError:
            pytest.skip("this torch refuses a grad of another dtype itself")
    else:
        params[-1].grad = params[-1].grad.to_sparse()
    with pytest.raises(ValueError):
        opt.step()
    _assert_unchanged(opt, params, snapshot)


def test_duplicate_params_are_rejected(gen):
    p = make_params([(4, 6)], gen)[0]
    with pytest.raises(ValueError):
        Muon([{"params": [p]}, {"params": [p]}])


@pytest.mark.parametrize("case", ["muon", "normuon"])
def test_deepcopy_continues_like_the_original(case, gen):
    import copy

    ours_cls, _, kwargs = CASES[case]
    params = make_params(SHAPES, gen, scale=0.1)
    opt = ours_cls(params, **kwargs)
    run_steps(opt, params, make_grads(params, gen, 2))
    twin = copy.deepcopy(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    assert twin_params[0] is not params[0] and torch.equal(twin_params[0], params[0])
    grads = make_grads(params, gen, 2)
    run_steps(opt, params, grads)
    run_steps(twin, twin_params, grads)
    for p, q in zip(params, twin_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _megatron_tp_classes():
    """Megatron-LM's TensorParallelMuon / TensorParallelAdaptiveMuon (on Emerging-Optimizers), or None."""
    try:
        import megatron.core.optimizer.emerging_optimizers as mcore_eo
    except ImportError:
        return None
    if not getattr(mcore_eo, "HAVE_EMERGING_OPTIMIZERS", False):
        return None
    return mcore_eo.TensorParallelMuon, mcore_eo.TensorParallelAdaptiveMuon


def _group_dicts(opt):
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]


def _reference_classes():
    refs = {
        "muon": (Muon, eo.Muon, {}),
        "adaptive_muon": (AdaptiveMuon, eo.AdaptiveMuon, dict(momentum=0.9, moment2_method="adamuon")),
    }
    tp = _megatron_tp_classes()
    if tp is not None:
        refs["tp_muon"] = (TensorParallelMuon, tp[0], {})
        refs["tp_adaptive_muon"] = (TensorParallelAdaptiveMuon, tp[1], {})
    return refs


@pytest.mark.parametrize("case", ["muon", "adaptive_muon", "tp_muon", "tp_adaptive_muon"])
def test_param_group_keys_survive_load_state_dict_like_the_reference(case, gen):
    # state_dict -> load_state_dict -> state_dict keeps every group's keys and values; the keys
    # are those Emerging-Optimizers' class (Megatron-LM's TP classes for tp_*) gives for the
    # same construction. torch's Optimizer.__setstate__ adds differentiable=False to defaults:
    # it must not leak into the groups.
    refs = _reference_classes()
    if case not in refs:
        pytest.skip("megatron-core with Emerging-Optimizers is not installed")
    ours_cls, ref_cls, kwargs = refs[case]

    def build(cls):
        ps = make_params(SHAPES, gen, scale=0.1)
        groups = [
            {"params": ps[:2], "wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False},
            {"params": ps[2:], "wd_mult": 0.0, "lr": 0.5},
        ]
        return cls(groups, lr=0.02, weight_decay=0.1, **kwargs), ps

    ours, params = build(ours_cls)
    ref, ref_params = build(ref_cls)
    run_steps(ours, params, make_grads(params, gen, 1))
    before = _group_dicts(ours)
    assert [sorted(g) for g in before] == [sorted(g) for g in _group_dicts(ref)]
    ours.load_state_dict(ours.state_dict())
    assert _group_dicts(ours) == before
    ours.load_state_dict(ours.state_dict())  # and again: nothing accumulates
    assert _group_dicts(ours) == before
    ref.load_state_dict(ref.state_dict())
    assert [sorted(g) for g in _group_dicts(ours)] == [sorted(g) for g in _group_dicts(ref)]
    import copy

    assert _group_dicts(copy.deepcopy(ours)) == before


def test_loaded_group_without_second_moment_values_gets_them_from_defaults(gen):
    # A group saved without beta2 / eps (e.g. by a class without a second moment) is loaded:
    # the per-step values the step reads come from the optimizer's defaults; nothing else is added.
    params = make_params(SHAPES, gen, scale=0.1)
    opt = AdaptiveMuon(params, lr=0.02, momentum=0.9, weight_decay=0.1, moment2_method="adamuon", beta2=0.8, eps=1e-6)
    saved = opt.state_dict()
    for g in saved["param_groups"]:
        del g["beta2"], g["eps"]
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert group["beta2"] == 0.8 and group["eps"] == 1e-6
    assert "differentiable" not in group
    run_steps(opt, params, make_grads(params, gen, 1))
