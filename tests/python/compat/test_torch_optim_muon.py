"""megatron_eopt.torch_optim.Muon against torch.optim.Muon: numerics (torch's own class at its bf16
precision, a float64 re-expression of its algorithm at fp32), per-group settings, checkpoints in
both directions, errors and their timing, closure, torch.compile and dynamo."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron_eopt.torch_optim import Muon

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")

SHAPES = [(1, 7), (7, 1), (97, 37), (37, 97), (16, 16), (48, 12)]
# Two bf16 Newton–Schulz results (torch rounds every product to bf16, ours accumulates in fp32):
# each within the bf16 tolerance (2e-2) of the exact result, so within twice that of each other.
BF16_PAIR = 4e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert math.isfinite(err)
    return err


def make_params(shapes, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def set_grads(param_lists, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) * scale for p in param_lists[0]]
    for params in param_lists:
        for p, grad in zip(params, grads):
            p.grad = grad.to(p.dtype)
    return grads


# ---------------------------------------------------------------- float64 re-expression of torch's step
def reference_ns(x: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch's Newton–Schulz, in float64: Frobenius normalization clamped at eps, iterated on the
    wide orientation, each step X <- aX + (bA + cA^2)X with A = X X^T."""
    a, b, c = coefficients
    tall = x.shape[0] > x.shape[1]
    X = x.T if tall else x
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def reference_ratio(adjust_lr_fn, shape) -> float:
    m, n = shape
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(m / n)


def reference_step(params, grads, buffers, group) -> None:
    """One torch.optim.Muon step of one group, float64 in place."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    for p, g, buf in zip(params, grads, buffers):
        buf.lerp_(g, 1 - mu)
        u = g.lerp(buf, mu) if group["nesterov"] else buf
        u = reference_ns(u, group["ns_coefficients"], group["ns_steps"], group["eps"])
        p.mul_(1 - lr * wd)
        p.add_(u, alpha=-lr * reference_ratio(group["adjust_lr_fn"], p.shape))


GROUP_SETTINGS = [
    {},
    dict(nesterov=False, adjust_lr_fn="match_rms_adamw", ns_steps=3),
    dict(adjust_lr_fn="spectral_unclamped", ns_coefficients=(3.0, -3.2, 1.2), eps=1e-5, momentum=0.9),
]


def grouped(params, settings=GROUP_SETTINGS):
    groups, start = [], 0
    per = max(1, len(params) // len(settings))
    for i, extra in enumerate(settings):
        chunk = params[start:] if i == len(settings) - 1 else params[start:start + per]
        start += per
        groups.append({"params": chunk, **extra})
    return groups


def test_defaults_and_group_keys_are_torchs():
    p = torch.zeros(4, 3, requires_grad=True)
    ours, theirs = Muon([p]), torch.optim.Muon([p.detach().clone().requires_grad_()])
    assert ours.defaults == theirs.defaults
    assert list(ours.defaults) == list(theirs.defaults)
    assert {k: v for k, v in ours.param_groups[0].items() if k != "params"} == \
        {k: v for k, v in theirs.param_groups[0].items() if k != "params"}


@pytest.mark.parametrize("seed", [0, 1])
def test_fp32_matches_float64_reference_with_per_group_settings(seed):
    params = make_params(SHAPES, seed)
    ref = [p.detach().double() for p in params]
    bufs = [torch.zeros_like(p) for p in ref]
    opt = Muon(grouped(params), lr=0.02, weight_decay=0.05, fp32_matmul_prec="highest")
    start = [p.detach().clone().double() for p in params]
    for step in range(4):
        grads = set_grads([params], 100 * seed + step)
        opt.step()
        k = 0
        for group in opt.param_groups:
            n = len(group["params"])
            reference_step(ref[k:k + n], grads[k:k + n], bufs[k:k + n], group)
            k += n
    for p, r, s in zip(params, ref, start):
        # the movement of each parameter: fp32 Newton–Schulz against float64 (docs/design.md §9: fp32 <= 1e-5
        # per product; four steps of five to six products each)
        assert rel(p.detach() - s, r - s) < 1e-4, p.shape


@pytest.mark.parametrize("seed", [0, 1])
def test_default_precision_matches_torch(seed):
    params = make_params(SHAPES, seed)
    twins = clone_params(params)
    ours = Muon(grouped(params), lr=0.02)
    theirs = torch.optim.Muon(grouped(twins), lr=0.02)
    start = [p.detach().clone() for p in params]
    for step in range(4):
        set_grads([params, twins], 10 * seed + step)
        ours.step()
        theirs.step()
    for p, q, s in zip(params, twins, start):
        assert rel(p.detach() - s, q.detach() - s) < BF16_PAIR, p.shape
    for p, q in zip(params, twins):
        assert rel(ours.state[p]["momentum_buffer"], theirs.state[q]["momentum_buffer"]) < 1e-6


def test_group_settings_changed_between_steps_take_effect():
    params = make_params([(24, 8), (8, 24)], 3)
    ref = [p.detach().double() for p in params]
    bufs = [torch.zeros_like(r) for r in ref]
    opt = Muon(params, lr=0.01, fp32_matmul_prec="highest")
    start = [p.detach().clone().double() for p in params]
    changes = [{}, dict(nesterov=False), dict(adjust_lr_fn="match_rms_adamw", ns_steps=2),
               dict(ns_coefficients=(2.0, -1.5, 0.5), eps=1e-3)]
    for step, change in enumerate(changes):
        opt.param_groups[0].update(change)
        grads = set_grads([params], 50 + step)
        opt.step()
        reference_step(ref, grads, bufs, opt.param_groups[0])
    for p, r, s in zip(params, ref, start):
        assert rel(p.detach() - s, r - s) < 1e-4


def test_closure_is_called_with_grad_enabled_and_its_loss_returned():
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(7, 5)
    opt = Muon([w], lr=0.01)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = (x @ w).square().mean()
        loss.backward()
        return loss

    before = w.detach().clone()
    loss = opt.step(closure)
    assert calls == [True] and isinstance(loss, torch.Tensor)
    assert not torch.equal(before, w.detach())
    assert opt.step() is None


def test_momentum_of_one_and_more_is_accepted_as_in_torch():
    params = make_params([(6, 4)], 4)
    twins = clone_params(params)
    ours = Muon(params, lr=0.01, momentum=1.5, fp32_matmul_prec="highest")
    theirs = torch.optim.Muon(twins, lr=0.01, momentum=1.5)
    for step in range(2):
        set_grads([params, twins], step)
        ours.step()
        theirs.step()
    assert rel(ours.state[params[0]]["momentum_buffer"], theirs.state[twins[0]]["momentum_buffer"]) < 1e-6


# ---------------------------------------------------------------- checkpoints, both ways
def _step_both(a, pa, b, pb, seed):
    set_grads([pa, pb], seed)
    a.step()
    b.step()


def test_our_checkpoint_continues_in_torch():
    params = make_params([(12, 5), (5, 12)], 5)
    twins = clone_params(params)
    ours = Muon(params, lr=0.02, nesterov=False, adjust_lr_fn="match_rms_adamw")
    mirror = Muon(twins, lr=0.02, nesterov=False, adjust_lr_fn="match_rms_adamw")
    for step in range(2):
        _step_both(ours, params, mirror, twins, step)
    # torch built with its defaults restores the settings from the checkpoint
    torch_params = clone_params(twins)
    theirs = torch.optim.Muon(torch_params)
    theirs.load_state_dict(mirror.state_dict())
    assert theirs.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw" and not theirs.param_groups[0]["nesterov"]
    start = [p.detach().clone() for p in params]
    _step_both(ours, params, theirs, torch_params, 9)
    for p, q, s in zip(params, torch_params, start):
        assert rel(p.detach() - s, q.detach() - s) < BF16_PAIR


def test_torch_checkpoint_continues_in_ours_with_its_settings():
    params = make_params([(12, 5), (5, 12)], 6)
    twins = clone_params(params)
    theirs = torch.optim.Muon(params, lr=0.02, adjust_lr_fn="match_rms_adamw", nesterov=False)
    mirror = torch.optim.Muon(twins, lr=0.02, adjust_lr_fn="match_rms_adamw", nesterov=False)
    for step in range(2):
        _step_both(theirs, params, mirror, twins, step)
    ours_params = clone_params(twins)
    ours = Muon(ours_params)  # built with the defaults: the checkpoint's settings win, as in torch
    ours.load_state_dict(mirror.state_dict())
    assert ours.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    start = [p.detach().clone() for p in params]
    _step_both(theirs, params, ours, ours_params, 9)
    for p, q, s in zip(params, ours_params, start):
        assert rel(q.detach() - s, p.detach() - s) < BF16_PAIR
    assert ours.state_dict()["param_groups"] == mirror.state_dict()["param_groups"]


def test_state_dict_round_trip_is_exact():
    params = make_params([(9, 4), (4, 9)], 7)
    twins = clone_params(params)
    a = Muon(params, lr=0.02)
    set_grads([params], 0)
    a.step()
    b = Muon(twins, lr=0.02)
    for p, q in zip(params, twins):
        q.data.copy_(p.detach())
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # a state dict holds the optimizer's own tensors
    _step_both(a, params, b, twins, 1)
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- errors, as torch raises them
CONSTRUCTION_CASES = [
    dict(lr=-0.1),
    dict(lr=float("nan")),
    dict(lr=torch.tensor([0.1, 0.2])),
    dict(momentum=-0.5),
    dict(weight_decay=-1.0),
    dict(adjust_lr_fn="sqrt"),
]


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e), str(e)
    return None


@pytest.mark.parametrize("kwargs", CONSTRUCTION_CASES, ids=lambda k: next(iter(k)))
def test_construction_errors_are_torchs(kwargs):
    expected = _error(lambda: torch.optim.Muon([torch.zeros(3, 2, requires_grad=True)], **kwargs))
    assert expected is not None
    assert _error(lambda: Muon([torch.zeros(3, 2, requires_grad=True)], **kwargs)) == expected


@pytest.mark.parametrize("shape", [(3,), (2, 3, 4), ()])
def test_non_matrix_params_refused_at_construction(shape):
    make = lambda cls: cls([torch.zeros(3, 3, requires_grad=True), torch.zeros(shape, requires_grad=True)])  # noqa: E731
    assert _error(lambda: make(Muon)) == _error(lambda: make(torch.optim.Muon))


STEP_CASES = {
    "complex": lambda: torch.zeros(3, 3, dtype=torch.complex64, requires_grad=True),
    "sparse_grad": "sparse",
    "added_3d": "added_3d",
    "ns_steps_100": dict(ns_steps=100),
    "coefficients_2": dict(ns_coefficients=(3.0, -3.0)),
}


def _step_error(cls, case):
    good = torch.ones(4, 3, requires_grad=True)
    good.grad = torch.ones(4, 3)
    before = good.detach().clone()
    if callable(case):
        bad = case()
        bad.grad = torch.ones_like(bad)
        opt = cls([good, bad])
    elif case == "sparse":
        bad = torch.zeros(3, 3, requires_grad=True)
        bad.grad = torch.eye(3).to_sparse()
        opt = cls([good, bad])
    elif case == "added_3d":
        opt = cls([good])
        bad = torch.zeros(2, 3, 3, requires_grad=True)
        bad.grad = torch.ones_like(bad)
        opt.add_param_group({"params": [bad]})
    else:
        opt = cls([good], **case)
    error = _error(opt.step)
    return error, before, good


@pytest.mark.parametrize("case", list(STEP_CASES), ids=str)
def test_step_errors_are_torchs_and_change_nothing(case):
    expected, _, _ = _step_error(torch.optim.Muon, STEP_CASES[case])
    assert expected is not None
    got, before, good = _step_error(Muon, STEP_CASES[case])
    assert got == expected
    assert torch.equal(good.detach(), before)  # unlike torch, nothing was half-updated


def test_settings_torch_would_run_but_we_refuse_name_the_key():
    p = torch.zeros(3, 3, requires_grad=True)
    opt = Muon([p])
    p.grad = torch.ones(3, 3)
    opt.param_groups[0]["eps"] = 0.0
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['eps'\]"):
        opt.step()
    opt.param_groups[0]["eps"] = 1e-7
    opt.param_groups[0]["adjust_lr_fn"] = "none"
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['adjust_lr_fn'\]"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(3, 3))


# ---------------------------------------------------------------- compile, dynamo, low-memory state
def test_compiled_step_fullgraph_matches_eager():
    params = make_params([(16, 8), (8, 16)], 8)
    twins = clone_params(params)
    eager = Muon(params, lr=torch.tensor(0.02))
    compiled = Muon(twins, lr=torch.tensor(0.02))
    step = torch.compile(compiled.step, fullgraph=True, backend="eager")
    for s in range(3):
        set_grads([params, twins], s)
        eager.step()
        step()
        for group in (eager.param_groups[0], compiled.param_groups[0]):
            group["lr"].mul_(0.5)  # a scheduler writing a tensor lr in place: no recompile
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


def test_built_and_stepped_inside_dynamo():
    params = make_params([(6, 4), (3, 9)], 9)
    twins = clone_params(params)

    def train(ps, cls):
        opt = cls(ps, lr=0.02)
        for p in ps:
            p.grad = torch.ones_like(p)
        opt.step()
        return opt

    torch._dynamo.reset()
    opt = torch._dynamo.optimize("eager")(train)(params, Muon)
    train(twins, Muon)
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
    assert set(opt.state_dict()["state"]) == {0, 1}


@pytest.mark.parametrize("state_dtype", ["bf16", "int8"])
def test_low_memory_state_tracks_fp32_state(state_dtype):
    params = make_params([(32, 16)], 10)
    twins = clone_params(params)
    low = Muon(params, lr=0.02, state_dtype=state_dtype)
    full = Muon(twins, lr=0.02)
    start = params[0].detach().clone()
    for s in range(3):
        _step_both(low, params, full, twins, s)
    assert rel(params[0].detach() - start, twins[0].detach() - start) < 5e-2
