"""newton_schulz_: the Newton–Schulz op in place, which the optimizers' step calls where nothing reads
its input afterwards. It must give the out-of-place op's result bit for bit on every path (algorithm,
precision, schedule length, recipe, transposed and batched shapes), and refuse bad input before
writing anything."""

from __future__ import annotations

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.ops._newton_schulz import _ns_arguments
from megatron_eopt.optim import AdaptiveMuon, Muon
from optim_helpers import make_params

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SHAPES = [(1, 9), (9, 1), (5, 5), (17, 40), (40, 17), (3, 17, 40), (3, 40, 17), (2, 97, 37)]
RECIPES = {
    "default": ("clamp", 1.0, False, False),
    "muoneq_muonplus": ("add", 1.05, True, True),
}
_op = torch.ops.megatron_eopt


def _both(x, steps, precision, algorithm, recipe, coefficient_type="quintic"):
    coefficients, repeat_last = _ns_arguments(steps, coefficient_type, None, 1e-7, precision, algorithm)
    args = (coefficients, steps, repeat_last, 1e-7, None, precision, algorithm, *RECIPES[recipe])
    want = _op.newton_schulz(x, *args)
    got = x.clone()
    assert _op.newton_schulz_(got, *args) is None
    return want, got


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("steps", [4, 5])  # even and odd: where the normalized input lands differs
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_in_place_equals_the_op(device, precision, algorithm, steps, recipe, gen):
    for shape in SHAPES:
        x = torch.randn(shape, generator=gen).to(device)
        want, got = _both(x, steps, precision, algorithm, recipe)
        assert torch.equal(got, want), shape


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["medium", "highest"])
def test_a_slice_at_any_offset_is_orthogonalized_in_place_and_its_neighbours_left_alone(device, precision, gen):
    # Slices of one buffer, as the step's stacks are: on CUDA under "medium" the products may use
    # the input's own storage, where it is aligned and large enough; a slice at an odd offset or
    # a small one takes scratch of its own, and nothing outside the slice is touched either way.
    for shape, offset in (((3, 17, 40), 0), ((3, 17, 40), 1), ((2, 40, 17), 7), ((16, 16), 64), ((5, 5), 3)):
        count = torch.Size(shape).numel()
        flat = torch.randn(offset + count + 11, generator=gen).to(device)
        x = flat[offset : offset + count].view(shape)
        coefficients, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, precision, "standard")
        args = (coefficients, 5, repeat_last, 1e-7, None, precision, "standard", *RECIPES["default"])
        want = _op.newton_schulz(x.clone(), *args)
        before = flat.clone()
        _op.newton_schulz_(x, *args)
        assert torch.equal(x, want), (shape, offset)
        assert torch.equal(flat[:offset], before[:offset]) and torch.equal(flat[offset + count :], before[offset + count :])


@pytest.mark.parametrize("device", DEVICES)
def test_every_schedule_and_auto(device, gen):
    for coefficient_type, steps in (("polar_express", 8), ("simple", 1), ("cans", 3)):
        for shape in ((64, 96), (4, 96, 64)):
            x = torch.randn(shape, generator=gen).to(device)
            want, got = _both(x, steps, "highest", "auto", "default", coefficient_type)
            assert torch.equal(got, want), (coefficient_type, shape)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_is_refused_and_left_as_it_was(device, gen):
    coefficients, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, "highest", "auto")
    strided = torch.randn(12, 8, generator=gen).to(device).t()
    before = strided.clone()
    with pytest.raises(RuntimeError, match="newton_schulz_: x must be contiguous"):
        _op.newton_schulz_(strided, coefficients, 5, repeat_last, 1e-7, None, "highest", "auto")
    assert torch.equal(strided, before)
    half = torch.randn(8, 12, generator=gen).to(device).half()
    with pytest.raises(RuntimeError, match="float32"):
        _op.newton_schulz_(half, coefficients, 5, repeat_last, 1e-7, None, "highest", "auto")
    empty = torch.empty(0, 5, device=device)
    _op.newton_schulz_(empty, coefficients, 5, repeat_last, 1e-7, None, "highest", "auto")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_a_tensor_that_requires_grad_is_orthogonalized_as_any_other(device, algorithm, gen):
    # A non-leaf of a graph (its BLAS out= products are written through a detached alias).
    coefficients, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, "highest", algorithm)
    p = torch.randn(40, 24, generator=gen).to(device).requires_grad_()
    y = p * 2.0
    args = (coefficients, 5, repeat_last, 1e-7, None, "highest", algorithm)
    want = _op.newton_schulz(y.detach(), *args)
    _op.newton_schulz_(y, *args)
    assert torch.equal(y.detach(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    for precision in ("medium", "highest"):
        coefficients, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, precision, "auto")
        for shape in ((24, 40), (2, 40, 24)):
            x = torch.randn(shape, generator=gen).to(device)
            torch.library.opcheck(_op.newton_schulz_.default,
                                  (x, coefficients, 5, repeat_last, 1e-7, None, precision, "auto"))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_in_place_call_matches_eager(device, gen):
    coefficients, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, "highest", "auto")

    def fn(x):
        y = x * 2.0
        _op.newton_schulz_(y, coefficients, 5, repeat_last, 1e-7, None, "highest", "auto")
        return y + 1.0

    x = torch.randn(3, 24, 40, generator=gen).to(device)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True)(x), fn(x), rtol=0, atol=0)


# ------------------------------------------------------------------ the optimizers' use of it
def _ns_calls(monkeypatch):
    """Counts the Newton–Schulz ops the optimizers look up (in place and not) from now on."""
    calls = {"newton_schulz_": 0, "newton_schulz": 0}
    real_ops = torch.ops.megatron_eopt

    class Counting:
        def __getattr__(self, name):
            if name in calls:
                calls[name] += 1
            return getattr(real_ops, name)

    monkeypatch.setattr(torch.ops, "megatron_eopt", Counting())
    return calls


@pytest.mark.parametrize("method,in_place", [(None, True), ("adamuon", True), ("normuon", True), ("namo", False)])
def test_the_step_orthogonalizes_in_place_unless_the_inputs_are_read_after(method, in_place, monkeypatch, gen):
    # NAMO's normalization reads the Newton–Schulz inputs after the iteration; the others do not.
    shapes = [(24, 40), (24, 40), (40, 24)]
    params = make_params(shapes, gen)
    opt = Muon(params, lr=0.02) if method is None else AdaptiveMuon(params, 0.02, 0.95, 0.01, moment2_method=method)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    calls = _ns_calls(monkeypatch)
    opt.step()
    assert calls == ({"newton_schulz_": 2, "newton_schulz": 0} if in_place else {"newton_schulz_": 0,
                                                                                  "newton_schulz": 2})


class _Override(Muon):
    def orthogonalize(self, p, grad, **kwargs):
        return super().orthogonalize(p, grad, **kwargs) * 0.5


def test_an_orthogonalize_override_keeps_the_inputs(monkeypatch, gen):
    params = make_params([(24, 40), (40, 24)], gen)
    opt = _Override(params, lr=0.02)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    calls = _ns_calls(monkeypatch)
    opt.step()
    assert calls["newton_schulz_"] == 0 and calls["newton_schulz"] == 2


def test_the_cuda_step_orthogonalizes_in_place_only_when_switched_on():
    # Not yet measured on a GPU: off by default there, always on for the CPU.
    assert me.in_place_newton_schulz("cpu")
    before = me.in_place_newton_schulz("cuda")
    try:
        me.set_in_place_newton_schulz(cuda=True)
        assert me.in_place_newton_schulz(torch.device("cuda", 0))
        me.set_in_place_newton_schulz(cuda=False)
        assert not me.in_place_newton_schulz("cuda") and me.in_place_newton_schulz("cpu")
        with pytest.raises(TypeError, match="cuda must be True or False"):
            me.set_in_place_newton_schulz(cuda=1)
    finally:
        me.set_in_place_newton_schulz(cuda=before)


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
def test_cuda_muon_step_is_the_same_either_way(in_place, gen):
    shapes = [(24, 40), (24, 40), (40, 24), (9, 1)]
    start = make_params(shapes, gen)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    results = []
    before = me.in_place_newton_schulz("cuda")
    try:
        for flag in (False, in_place):
            me.set_in_place_newton_schulz(cuda=flag)
            params = [torch.nn.Parameter(p.detach().cuda()) for p in start]
            opt = Muon(params, lr=0.02)
            for _ in range(3):
                for p, g in zip(params, grads):
                    p.grad = g.cuda()
                opt.step()
            results.append([p.detach().cpu() for p in params])
    finally:
        me.set_in_place_newton_schulz(cuda=before)
    for a, b in zip(*results):
        assert torch.equal(a, b)
