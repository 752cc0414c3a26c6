import math

import pytest
import torch

from megatron_eopt.schedulers import build_schedulers, lr_multiplier


def _two_optimizers():
    a = torch.nn.Parameter(torch.randn(4, 4))
    b = torch.nn.Parameter(torch.randn(4))
    return [torch.optim.SGD([a], lr=0.02), torch.optim.AdamW([b], lr=3e-4)]


def _lrs(opt, scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_warmup_then_decay_to_min_ratio(decay):
    warmup, total, ratio = 4, 12, 0.1
    opts = _two_optimizers()
    scheds = build_schedulers(opts, warmup_steps=warmup, total_steps=total, decay=decay, min_lr_ratio=ratio)
    assert len(scheds) == 2 and all(isinstance(s, torch.optim.lr_scheduler.LambdaLR) for s in scheds)
    for opt, sched, base in zip(opts, scheds, (0.02, 3e-4)):
        lrs = _lrs(opt, sched, total + 3)
        # warmup: (s+1)/warmup, reaching the full lr on the last warmup step
        assert lrs[:warmup] == pytest.approx([base * (s + 1) / warmup for s in range(warmup)])
        for s in range(warmup, total + 3):
            progress = min(1.0, (s - warmup) / (total - warmup))
            shape = 1 - progress if decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
            assert lrs[s] == pytest.approx(base * (ratio + (1 - ratio) * shape)), s
        assert lrs[warmup] == pytest.approx(base)
        assert lrs[total:] == pytest.approx([base * ratio] * 3)


def test_cosine_midpoint_and_monotone():
    f = lr_multiplier(0, 100, "cosine", 0.0)
    assert f(0) == pytest.approx(1.0)
    assert f(50) == pytest.approx(0.5)
    values = [f(s) for s in range(101)]
    assert all(x >= y for x, y in zip(values, values[1:]))
    assert values[-1] == pytest.approx(0.0, abs=1e-12)


def test_constant_and_no_warmup():
    f = lr_multiplier(3, 10, "constant")
    assert [f(s) for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    g = lr_multiplier(0, 10, "linear", 0.5)
    assert g(0) == 1.0 and g(10) == pytest.approx(0.5) and g(5) == pytest.approx(0.75)


def test_all_groups_follow_the_schedule():
    p, q = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([{"params": [p], "lr": 1.0}, {"params": [q], "lr": 0.1}])
    (sched,) = build_schedulers(opt, warmup_steps=2, total_steps=4)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.05])
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1.0, 0.1])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(warmup_steps=-1, total_steps=10), "warmup_steps"),
        (dict(warmup_steps=0, total_steps=0), "total_steps"),
        (dict(warmup_steps=11, total_steps=10), "must not exceed"),
        (dict(warmup_steps=1, total_steps=10, decay="step"), "decay"),
        (dict(warmup_steps=1, total_steps=10, min_lr_ratio=1.5), "min_lr_ratio"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_schedulers(_two_optimizers(), **kwargs)


def test_rejects_non_optimizer():
    with pytest.raises(TypeError, match=r"optimizers\[1\]"):
        build_schedulers([_two_optimizers()[0], object()], warmup_steps=1, total_steps=2)
