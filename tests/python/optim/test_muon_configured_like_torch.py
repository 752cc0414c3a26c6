"""Muon configured like torch.optim.Muon: same update, same state, state_dicts load both ways.

torch.optim.Muon: momentum EMA (lerp), Nesterov lerp(g, M, μ), Keller Jordan's "simple" NS in
bf16, decoupled decay p *= 1 - lr·wd, lr adjusted per shape: "original" = shape_scaling,
"match_rms_adamw" = spectral × 0.2, "spectral_unclamped" = unit_rms_norm.
"""

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.optim import Muon
from optim_helpers import SHAPES, clone_params, continued_delta_err, make_grads
from optim_helpers import make_params, max_delta_err, run_steps
from reference import TOLERANCE

ADJUST = {
    "original": ("shape_scaling", 1.0),
    "match_rms_adamw": ("spectral", 0.2),
    "spectral_unclamped": ("unit_rms_norm", 1.0),
}
RECTANGULAR = [(97, 37), (37, 97), (24, 40), (40, 24)]

torch_muon = pytest.importorskip("torch.optim._muon", reason="torch.optim.Muon needs torch >= 2.9")


def _torch_muon(params, adjust_lr_fn="original", nesterov=True):
    try:
        return torch.optim.Muon(
            params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn
        )
    except ValueError:
        pytest.skip(f"this torch.optim.Muon has no adjust_lr_fn={adjust_lr_fn!r}")


@pytest.fixture
def fp32_torch_muon(monkeypatch):
    if not hasattr(torch_muon, "_zeropower_via_newtonschulz"):
        pytest.skip("this torch.optim.Muon has no _zeropower_via_newtonschulz to replace")
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_zeropower)


def _ours(params, adjust_lr_fn, nesterov, precision, **kw):
    scale_mode, extra = ADJUST[adjust_lr_fn]
    return Muon(
        params,
        lr=kw.get("lr", 0.02),
        momentum=0.95,
        weight_decay=kw.get("weight_decay", 0.1),
        nesterov=nesterov,
        coefficient_type="simple",
        num_ns_steps=5,
        scale_mode=scale_mode,
        extra_scale_factor=extra,
        fp32_matmul_prec=precision,
    )


def _fp32_zeropower(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton–Schulz replaced by our op in fp32 with its (a, b, c) row.

    The op itself is checked against float64 in test_newton_schulz.py; sharing it here isolates
    what this file checks: momentum, Nesterov, weight decay and the lr adjustment.
    """
    return me.newton_schulz(grad.float(), ns_steps, "custom", [ns_coefficients], eps, precision="highest")


@pytest.mark.parametrize("adjust_lr_fn", list(ADJUST))
@pytest.mark.parametrize("nesterov", [True, False])
def test_update_semantics_match_in_fp32(adjust_lr_fn, nesterov, gen, fp32_torch_muon):
    # With the same fp32 NS, torch.optim.Muon must agree with ours at fp32 precision.
    # Small weights: the fp32 rounding of p itself must stay far below the compared change of p.
    params = make_params(SHAPES, gen, scale=0.1)
    start = [p.detach().clone() for p in params]
    ref_params = clone_params(params)
    grads = make_grads(params, gen, 3)
    ours = _ours(params, adjust_lr_fn, nesterov, "highest")
    ref = _torch_muon(ref_params, adjust_lr_fn, nesterov)
    run_steps(ours, params, grads)
    run_steps(ref, ref_params, grads)
    assert max_delta_err(params, ref_params, start) <= TOLERANCE["highest"]
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(ours.state[p]["momentum_buffer"], ref.state[r]["momentum_buffer"])


def test_bf16_newton_schulz_matches_at_bf16_tolerance(gen):
    # Unpatched: both run NS in bf16 (torch.optim.Muon also normalizes in bf16), so the two differ
    # by independent bf16 rounding; on rank-deficient or square inputs that rounding is chaotic
    # enough to approach the tolerance by itself, hence full-rank rectangular shapes here.
    params = make_params(RECTANGULAR, gen)
    start = [p.detach().clone() for p in params]
    ref_params = clone_params(params)
    grads = make_grads(params, gen, 3)
    run_steps(_ours(params, "original", True, "medium"), params, grads)
    run_steps(_torch_muon(ref_params), ref_params, grads)
    assert max_delta_err(params, ref_params, start) <= TOLERANCE["medium"]


def _fill_torch_group_keys(optimizer, state_dict):
    """Load pre-hook for torch.optim.Muon: it reads its NS settings from the param groups."""
    state_dict = dict(state_dict)
    state_dict["param_groups"] = [{**optimizer.defaults, **g} for g in state_dict["param_groups"]]
    return state_dict


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_interop(direction, gen, fp32_torch_muon):
    params = make_params(SHAPES, gen, scale=0.1)
    grads = make_grads(params, gen, 5)
    # straight run of the class that continues, for the comparison
    straight = clone_params(params)
    first_params = clone_params(params)
    if direction == "torch_to_ours":
        first = _torch_muon(first_params)
        make_second = lambda ps: _ours(ps, "original", True, "highest")  # noqa: E731
    else:
        first = _ours(first_params, "original", True, "highest")
        make_second = _torch_muon
    straight_opt = make_second(straight)
    run_steps(straight_opt, straight, grads[:2])  # the same history, run by the continuing class
    run_steps(first, first_params, grads[:2])
    second = make_second(first_params)
    if isinstance(second, torch.optim.Muon):
        second.register_load_state_dict_pre_hook(_fill_torch_group_keys)
    second.load_state_dict(first.state_dict())
    for p, r in zip(first_params, straight):
        torch.testing.assert_close(second.state[p]["momentum_buffer"], straight_opt.state[r]["momentum_buffer"])
    assert continued_delta_err(second, first_params, straight_opt, straight, grads[2:]) <= TOLERANCE["highest"]
