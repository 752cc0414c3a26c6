"""load_state_dict refuses a state tensor that does not fit its parameter, before anything changes."""

import copy
import re
import warnings

import pytest
import torch

from megatron_eopt.optim import AdaptiveMuon, HybridMuon, Muon
from optim_helpers import make_grads, make_params, run_steps

# Shapes where a transposed buffer has the parameter's numel (the silent case) and a prime one.
SHAPES = [(8, 4), (7, 5), (3, 11)]


def _legacy_muon(params):
    from megatron_eopt import muon as legacy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return legacy.Muon(params, lr=0.02)


def _hybrid(params):
    return HybridMuon([{"params": params[:2], "use_muon": True}, {"params": params[2:], "use_muon": False}],
                      lr=0.02)


BUILDERS = {
    "muon": lambda ps: Muon(ps, lr=0.02),
    "normuon": lambda ps: AdaptiveMuon(ps, lr=0.02, momentum=0.95, weight_decay=0.01, moment2_method="normuon"),
    "adamuon": lambda ps: AdaptiveMuon(ps, lr=0.02, momentum=0.95, weight_decay=0.01, moment2_method="adamuon"),
    "namo": lambda ps: AdaptiveMuon(ps, lr=0.02, momentum=0.95, weight_decay=0.01, moment2_method="namo"),
    "hybrid": _hybrid,
    "legacy_muon": _legacy_muon,
}


def _trained(name, gen):
    params = make_params(SHAPES, gen, scale=0.1)
    opt = BUILDERS[name](params)
    run_steps(opt, params, make_grads(params, gen, 2))
    return params, opt


def _snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for p, s in opt.state.items()}


def _assert_unchanged(opt, before, groups_before):
    assert opt.param_groups is groups_before[0]
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups] == groups_before[1]
    for p, s in opt.state.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, before[id(p)][k])


def _keys(opt, p):
    return [k for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.ndim >= 2]


def _where(opt, p):
    """(group, position) of p in the optimizer (the legacy Muon regroups params as nanochat does)."""
    for gi, group in enumerate(opt.param_groups):
        for pi, q in enumerate(group["params"]):
            if q is p:
                return gi, pi
    raise AssertionError("not a parameter of the optimizer")


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_transposed_buffer_is_refused_naming_param_key_and_shapes(name, gen):
    params, opt = _trained(name, gen)
    target = params[1] if name != "hybrid" else params[2]  # the hybrid's third param is on the AdamW side
    gi, pi = _where(opt, target)
    saved = copy.deepcopy(opt.state_dict())
    index = saved["param_groups"][gi]["params"][pi]
    key = _keys(opt, target)[0]
    bad = saved["state"][index][key]
    saved["state"][index][key] = bad.transpose(-2, -1).contiguous() if bad.shape[-1] != bad.shape[-2] else bad[..., :1]
    before, groups = _snapshot(opt), (opt.param_groups, [dict((k, v) for k, v in g.items() if k != "params")
                                                          for g in opt.param_groups])
    with pytest.raises(ValueError) as info:
        opt.load_state_dict(saved)
    message = str(info.value)
    assert f"param_groups[{gi}]['params'][{pi}]" in message
    assert f"'{key}'" in message
    assert str(tuple(saved["state"][index][key].shape)) in message
    assert str(tuple(target.shape)) in message
    _assert_unchanged(opt, before, groups)


@pytest.mark.parametrize("name", ["muon", "normuon", "legacy_muon"])
def test_a_buffer_of_another_numel_is_refused_not_a_view_error(name, gen):
    params, opt = _trained(name, gen)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["momentum_buffer"] = torch.randn(5, 5, generator=gen)
    with pytest.raises(ValueError, match=re.escape("has shape (5, 5)")):
        opt.load_state_dict(saved)


def test_a_wrong_second_moment_layout_is_refused(gen):
    params, opt = _trained("normuon", gen)
    saved = copy.deepcopy(opt.state_dict())
    v = saved["state"][0]["moment2_buffer"]  # (8, 1) for the tall (8, 4)
    saved["state"][0]["moment2_buffer"] = v.reshape(1, -1)
    with pytest.raises(ValueError, match=re.escape("'moment2_buffer'")):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("name", ["muon", "hybrid"])
def test_a_buffer_that_cannot_be_cast_or_moved_is_refused(name, gen):
    params, opt = _trained(name, gen)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["momentum_buffer"] = torch.randint(0, 3, (8, 4), generator=gen)
    with pytest.raises(ValueError, match="cannot be cast"):
        opt.load_state_dict(saved)
    saved["state"][0]["momentum_buffer"] = torch.empty(8, 4, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_fitting_checkpoint_still_loads_with_a_castable_dtype(name, gen):
    params, opt = _trained(name, gen)
    saved = copy.deepcopy(opt.state_dict())
    for s in saved["state"].values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and v.ndim >= 2:
                s[k] = v.double()  # cast back to the parameter's dtype by the load
    expected = {k: v.float() for k, v in saved["state"][0].items() if isinstance(v, torch.Tensor)}
    opt.load_state_dict(saved)
    for k, v in expected.items():
        assert torch.equal(opt.state[params[0]][k].float(), v)
