"""megatron_eopt.torch_optim.Muon beyond torch.optim.Muon: the opt-in group keys nd_mode ("batch",
"flatten"), algorithm ("standard", "gram") and split_heads, each against the per-matrix definition
(torch's own Muon stepping every matrix as a 2-D parameter, in float64 with its Newton–Schulz in
float64, and at torch's own bf16 precision), checkpoints both ways, errors naming the key, settings
changed between steps, torch.compile; and muon_param_groups' routing."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from megatron_eopt import build_optimizers
from megatron_eopt.param_routing import route_parameters
from megatron_eopt.torch_optim import Muon, muon_param_groups

torch_muon = pytest.importorskip("torch.optim._muon", reason="torch.optim.Muon needs torch >= 2.9")

ADJUST_LR_FNS = [None, "match_rms_adamw", "spectral_unclamped"]
# Movement of fp32 parameters (Newton–Schulz at "highest") against float64, over a few steps of five
# products each (as test_torch_optim_muon.py).
FP32_VS_FLOAT64 = 1e-4
# Two bf16 Newton–Schulz results (torch rounds every product to bf16, ours accumulates in fp32).
BF16_PAIR = 4e-2
STEPS = 3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert math.isfinite(err)
    return err


def _ns_float64(grad, ns_coefficients, ns_steps, eps):
    """torch's Newton–Schulz re-expressed in float64: Frobenius normalization clamped at eps, the
    iteration X <- aX + (bA + cA^2)X, A = X X^T, on the wide orientation."""
    a, b, c = ns_coefficients
    x = grad.to(torch.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.fixture
def float64_torch_muon(monkeypatch):
    """torch.optim.Muon with its Newton–Schulz in float64: on float64 params, torch's step exactly."""
    if not hasattr(torch_muon, "_zeropower_via_newtonschulz"):
        pytest.skip("this torch.optim.Muon has no _zeropower_via_newtonschulz to replace")
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _ns_float64)


def _start(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _grads(shape, seed, steps=STEPS):
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(steps)]


def _run_pair(ours_group: dict, shape, to_matrices, seed, *, reference_dtype=torch.float64, ours_kwargs=None,
              torch_kwargs=None, steps=STEPS):
    """Steps one param of ``shape`` with ours and the matrices ``to_matrices(param)`` (views of a copy)
    each as a 2-D param of torch's Muon, with the same gradients. Returns (ours' movement, torch's
    movement laid out as the param, ours, the param)."""
    start = _start(shape, seed)
    p = nn.Parameter(start.float())
    twin = start.to(reference_dtype).clone()
    pieces = [nn.Parameter(v.clone()) for v in to_matrices(twin)]
    kwargs = dict(lr=0.02, weight_decay=0.1, **(ours_kwargs or {}))
    ours = Muon([{"params": [p], **ours_group}], **kwargs)
    theirs = torch.optim.Muon(pieces, lr=0.02, weight_decay=0.1, **(torch_kwargs or {}))
    for grad in _grads(shape, seed, steps):
        p.grad = grad.float()
        for q, g in zip(pieces, to_matrices(grad.to(reference_dtype))):
            q.grad = g.clone()
        ours.step()
        theirs.step()
    moved = twin.clone()
    for view, q in zip(to_matrices(moved), pieces):
        view.copy_(q.detach())
    return p.detach().double() - start, moved.double() - start, ours, p


def batch_matrices(t):
    return list(t.view(-1, *t.shape[-2:]).unbind(0))


def flatten_matrix(t):
    return [t.view(t.shape[0], -1)]


def head_blocks(heads):
    return lambda t: list(t.view(t.shape[0], -1).chunk(heads, dim=0))


# ---------------------------------------------------------------- nd_mode="batch"
@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
@pytest.mark.parametrize("shape", [(4, 12, 7), (2, 3, 5, 9), (3, 8, 8)])
def test_batch_is_torch_per_matrix_in_float64(shape, adjust_lr_fn, float64_torch_muon):
    ours_moved, ref_moved, ours, p = _run_pair(
        {"nd_mode": "batch", "adjust_lr_fn": adjust_lr_fn}, shape, batch_matrices, 1,
        ours_kwargs=dict(fp32_matmul_prec="highest"), torch_kwargs=dict(adjust_lr_fn=adjust_lr_fn))
    for mine, ref in zip(batch_matrices(ours_moved), batch_matrices(ref_moved)):
        assert rel(mine, ref) < FP32_VS_FLOAT64
    assert ours.state[p]["momentum_buffer"].shape == p.shape  # torch's state layout: shaped like the param


def test_batch_matches_torchs_own_muon_at_its_precision():
    # torch's class untouched (bf16 Newton–Schulz), ours at its default precision; full-rank
    # rectangular matrices, where two bf16 roundings stay apart by bf16 noise only.
    ours_moved, ref_moved, _, _ = _run_pair({"nd_mode": "batch"}, (3, 40, 24), batch_matrices, 2,
                                            reference_dtype=torch.float32)
    for mine, ref in zip(batch_matrices(ours_moved), batch_matrices(ref_moved)):
        assert rel(mine, ref) < BF16_PAIR


def test_batch_as_constructor_default_and_with_2d_params(float64_torch_muon):
    # nd_mode given to the constructor applies to every group; a 2-D param is one matrix under any mode.
    start3, start2 = _start((3, 6, 10), 3), _start((10, 6), 4)
    p3, p2 = nn.Parameter(start3.float()), nn.Parameter(start2.float())
    ours = Muon([{"params": [p3]}, {"params": [p2], "nd_mode": "flatten"}], lr=0.02, nd_mode="batch",
                fp32_matmul_prec="highest")
    assert [g["nd_mode"] for g in ours.param_groups] == ["batch", "flatten"]
    pieces = [nn.Parameter(v.clone()) for v in batch_matrices(start3.clone())] + [nn.Parameter(start2.clone())]
    theirs = torch.optim.Muon(pieces, lr=0.02)
    for g3, g2 in zip(_grads(start3.shape, 3), _grads(start2.shape, 4)):
        p3.grad, p2.grad = g3.float(), g2.float()
        for q, g in zip(pieces, batch_matrices(g3) + [g2]):
            q.grad = g.clone()
        ours.step()
        theirs.step()
    for mine, q, s in zip(batch_matrices(p3.detach()) + [p2.detach()], pieces,
                          batch_matrices(start3) + [start2]):
        assert rel(mine.double() - s, q.detach() - s) < FP32_VS_FLOAT64


# ---------------------------------------------------------------- nd_mode="flatten"
@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
@pytest.mark.parametrize("shape", [(6, 3, 3, 3), (16, 2, 3), (40, 2, 2, 2)])
def test_flatten_is_torch_on_the_flattened_matrix_in_float64(shape, adjust_lr_fn, float64_torch_muon):
    ours_moved, ref_moved, ours, p = _run_pair(
        {"nd_mode": "flatten", "adjust_lr_fn": adjust_lr_fn}, shape, flatten_matrix, 5,
        ours_kwargs=dict(fp32_matmul_prec="highest"), torch_kwargs=dict(adjust_lr_fn=adjust_lr_fn))
    assert rel(ours_moved, ref_moved) < FP32_VS_FLOAT64
    assert ours.state[p]["momentum_buffer"].shape == p.shape


def test_conv_weight_flattened_matches_torchs_own_muon_at_its_precision():
    ours_moved, ref_moved, _, _ = _run_pair({"nd_mode": "flatten"}, (24, 8, 3, 3), flatten_matrix, 6,
                                            reference_dtype=torch.float32)
    assert rel(ours_moved, ref_moved) < BF16_PAIR


# ---------------------------------------------------------------- split_heads
@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
@pytest.mark.parametrize("heads,head_dim,cols", [(4, 6, 20), (3, 16, 8), (2, 5, 5)])
def test_split_heads_is_torch_per_block_in_float64(heads, head_dim, cols, adjust_lr_fn, float64_torch_muon):
    # Each block (head_dim, cols) orthogonalized and scaled by adjust_lr_fn of its own shape.
    shape = (heads * head_dim, cols)
    ours_moved, ref_moved, ours, p = _run_pair(
        {"split_heads": heads, "adjust_lr_fn": adjust_lr_fn}, shape, head_blocks(heads), 7,
        ours_kwargs=dict(fp32_matmul_prec="highest"), torch_kwargs=dict(adjust_lr_fn=adjust_lr_fn))
    for mine, ref in zip(head_blocks(heads)(ours_moved), head_blocks(heads)(ref_moved)):
        assert rel(mine, ref) < FP32_VS_FLOAT64
    assert ours.state[p]["momentum_buffer"].shape == p.shape


def test_split_heads_of_a_flattened_weight(float64_torch_muon):
    heads = 3
    ours_moved, ref_moved, _, _ = _run_pair({"split_heads": heads, "nd_mode": "flatten"}, (12, 4, 5),
                                            head_blocks(heads), 8, ours_kwargs=dict(fp32_matmul_prec="highest"))
    for mine, ref in zip(head_blocks(heads)(ours_moved), head_blocks(heads)(ref_moved)):
        assert rel(mine, ref) < FP32_VS_FLOAT64


def test_split_heads_matches_torchs_own_muon_at_its_precision():
    ours_moved, ref_moved, _, _ = _run_pair({"split_heads": 4}, (4 * 16, 48), head_blocks(4), 9,
                                            reference_dtype=torch.float32)
    for mine, ref in zip(head_blocks(4)(ours_moved), head_blocks(4)(ref_moved)):
        assert rel(mine, ref) < BF16_PAIR


def test_split_heads_one_is_the_whole_matrix():
    start = _start((12, 8), 10)
    a, b = nn.Parameter(start.float()), nn.Parameter(start.float())
    opt_a = Muon([a], lr=0.02, split_heads=1)
    opt_b = Muon([b], lr=0.02)
    for grad in _grads(start.shape, 10):
        a.grad, b.grad = grad.float(), grad.float()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)


# ---------------------------------------------------------------- algorithm
RECTANGULAR = [(32, 96), (96, 32), (24, 64)]


def _run_algorithm(algorithm, precision, seed=11):
    params = [nn.Parameter(_start(s, seed + i).float()) for i, s in enumerate(RECTANGULAR)]
    kwargs = {} if algorithm is None else {"algorithm": algorithm}
    opt = Muon(params, lr=0.02, fp32_matmul_prec=precision, **kwargs)
    for step in range(STEPS):
        for i, p in enumerate(params):
            p.grad = _grads(p.shape, seed + i)[step].float()
        opt.step()
    return opt, [p.detach().double() - _start(s, seed + i) for i, (p, s) in enumerate(zip(params, RECTANGULAR))]


@pytest.mark.parametrize("algorithm", ["standard", "gram", "auto"])
def test_algorithm_is_torch_per_matrix_in_float64(algorithm, float64_torch_muon):
    opt, moved = _run_algorithm(algorithm, "highest")
    assert {stack.config.algorithm for stack in opt._plan.stacks} == {algorithm}
    twins = [nn.Parameter(_start(s, 11 + i)) for i, s in enumerate(RECTANGULAR)]
    theirs = torch.optim.Muon(twins, lr=0.02)
    for step in range(STEPS):
        for i, q in enumerate(twins):
            q.grad = _grads(q.shape, 11 + i)[step]
        theirs.step()
    for i, (mine, q) in enumerate(zip(moved, twins)):
        assert rel(mine, q.detach() - _start(RECTANGULAR[i], 11 + i)) < FP32_VS_FLOAT64


def test_gram_matches_standard_in_fp32_and_auto_is_the_default():
    _, standard = _run_algorithm("standard", "highest")
    _, gram = _run_algorithm("gram", "highest")
    for a, b in zip(gram, standard):
        assert rel(a, b) < 2 * FP32_VS_FLOAT64
    default, moved = _run_algorithm(None, "highest")
    auto, moved_auto = _run_algorithm("auto", "highest")
    assert "algorithm" not in default.param_groups[0] and auto.param_groups[0]["algorithm"] == "auto"
    for a, b in zip(moved, moved_auto):
        assert torch.equal(a, b)


def test_gram_matches_torchs_own_muon_at_its_precision():
    _, gram = _run_algorithm("gram", "medium")
    twins = [nn.Parameter(_start(s, 11 + i).float()) for i, s in enumerate(RECTANGULAR)]
    theirs = torch.optim.Muon(twins, lr=0.02)
    for step in range(STEPS):
        for i, q in enumerate(twins):
            q.grad = _grads(q.shape, 11 + i)[step].float()
        theirs.step()
    for i, (mine, q) in enumerate(zip(gram, twins)):
        assert rel(mine, q.detach().double() - _start(RECTANGULAR[i], 11 + i)) < BF16_PAIR


# ---------------------------------------------------------------- checkpoints
def _step(opt, params, seed):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    opt.step()


def test_torchs_checkpoint_loads_into_ours_built_with_the_keys():
    # torch's groups carry none of the keys: ours falls back to its constructor's values.
    params = [nn.Parameter(_start(s, 20 + i).float()) for i, s in enumerate(RECTANGULAR)]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    theirs = torch.optim.Muon(params, lr=0.02, adjust_lr_fn="match_rms_adamw")
    mirror = torch.optim.Muon(twins, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for step in range(2):
        _step(theirs, params, step)
        _step(mirror, twins, step)
    ours_params = [nn.Parameter(q.detach().clone()) for q in twins]
    ours = Muon(ours_params, algorithm="gram", nd_mode="batch")
    ours.load_state_dict(mirror.state_dict())
    assert ours.state_dict()["param_groups"] == mirror.state_dict()["param_groups"]  # loaded as saved
    assert {stack.config.algorithm for stack in ours._plan.stacks} == {"gram"}
    start = [p.detach().clone() for p in params]
    _step(theirs, params, 9)
    _step(ours, ours_params, 9)
    for p, q, s in zip(params, ours_params, start):
        assert rel(q.detach() - s, p.detach() - s) < BF16_PAIR


def test_ours_without_the_keys_loads_into_torchs_and_continues():
    params = [nn.Parameter(_start(s, 30 + i).float()) for i, s in enumerate(RECTANGULAR)]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    ours = Muon(params, lr=0.02, nesterov=False)
    mirror = Muon(twins, lr=0.02, nesterov=False)
    for step in range(2):
        _step(ours, params, step)
        _step(mirror, twins, step)
    saved = mirror.state_dict()
    reference = torch.optim.Muon([torch.zeros(2, 2, requires_grad=True)])
    assert set(saved["param_groups"][0]) == set(reference.state_dict()["param_groups"][0])  # no new keys
    torch_params = [nn.Parameter(q.detach().clone()) for q in twins]
    theirs = torch.optim.Muon(torch_params)
    theirs.load_state_dict(saved)
    start = [p.detach().clone() for p in params]
    _step(ours, params, 9)
    _step(theirs, torch_params, 9)
    for p, q, s in zip(params, torch_params, start):
        assert rel(p.detach() - s, q.detach() - s) < BF16_PAIR


def _extended_model_params(seed):
    experts = nn.Parameter(_start((3, 8, 6), seed).float())
    conv = nn.Parameter(_start((6, 2, 3, 3), seed + 1).float())
    qkv = nn.Parameter(_start((12, 10), seed + 2).float())
    return [experts, conv, qkv]


def _extended_groups(params):
    experts, conv, qkv = params
    return [{"params": [experts], "nd_mode": "batch", "algorithm": "gram"},
            {"params": [conv], "nd_mode": "flatten"},
            {"params": [qkv], "split_heads": 3, "algorithm": "standard"}]


def test_the_keys_are_saved_with_their_groups_and_restored():
    params = _extended_model_params(40)
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    a = Muon(_extended_groups(params), lr=0.02)
    for step in range(2):
        _step(a, params, step)
    saved = copy.deepcopy(a.state_dict())
    assert [{k: g.get(k) for k in ("nd_mode", "algorithm", "split_heads")} for g in saved["param_groups"]] == [
        {"nd_mode": "batch", "algorithm": "gram", "split_heads": None},
        {"nd_mode": "flatten", "algorithm": None, "split_heads": None},
        {"nd_mode": None, "algorithm": "standard", "split_heads": 3},
    ]
    # built with other values of the keys (and none on the last group): the checkpoint's win
    for p, q in zip(params, twins):
        q.data.copy_(p.detach())
    b = Muon([{"params": [twins[0]]}, {"params": [twins[1]]}, {"params": [twins[2]]}], lr=0.02, nd_mode="batch")
    b.load_state_dict(saved)
    assert b.state_dict()["param_groups"] == saved["param_groups"]
    _step(a, params, 5)
    _step(b, twins, 5)
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- errors, naming the key
BAD_CONSTRUCTOR_VALUES = [
    (dict(nd_mode="flat"), r"^nd_mode must be one of"),
    (dict(algorithm="fast"), r"^algorithm must be one of"),
    (dict(split_heads=0), r"^split_heads must be None or the number of heads"),
    (dict(split_heads=True), r"^split_heads must be None"),
    (dict(split_heads=2.0), r"^split_heads must be None"),
    (dict(split_heads=5), r"param_groups\[0\]\['split_heads'\] = 5 does not divide the 12 rows"),
]


@pytest.mark.parametrize("kwargs,message", BAD_CONSTRUCTOR_VALUES, ids=lambda v: str(v))
def test_bad_constructor_values_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Muon([torch.zeros(12, 4, requires_grad=True)], **kwargs)


BAD_GROUPS = [
    (dict(nd_mode="flat"), (2, 3, 4), r"param_groups\[1\]\['nd_mode'\] must be one of"),
    (dict(nd_mode=None), (3, 4), r"param_groups\[1\]\['nd_mode'\] must be one of"),
    (dict(algorithm="fast"), (3, 4), r"param_groups\[1\]\['algorithm'\] must be one of"),
    (dict(split_heads=-2), (4, 4), r"param_groups\[1\]\['split_heads'\] must be None or the number"),
    (dict(split_heads=3), (4, 4), r"param_groups\[1\]\['split_heads'\] = 3 does not divide"),
    (dict(split_heads=2, nd_mode="batch"), (2, 4, 4), r"param_groups\[1\]\['split_heads'\] splits the rows of one"),
]


@pytest.mark.parametrize("group,shape,message", BAD_GROUPS, ids=lambda v: str(v))
def test_bad_group_values_are_refused_by_add_param_group_and_change_nothing(group, shape, message):
    good = nn.Parameter(torch.ones(4, 3))
    opt = Muon([good], lr=0.02)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [torch.zeros(shape, requires_grad=True)], **group})
    assert opt.state_dict() == before and len(opt.param_groups) == 1
    good.grad = torch.ones(4, 3)
    opt.step()  # the optimizer still steps what it had


def test_a_param_without_the_matrix_view_names_nd_mode():
    permuted = torch.zeros(3, 2, 4, 5).transpose(0, 1).requires_grad_()  # leading dims not contiguous
    with pytest.raises(ValueError, match=r"cannot be viewed as matrices with nd_mode='batch'"):
        Muon([permuted], nd_mode="batch")
    with pytest.raises(ValueError, match=r"cannot be viewed as matrices with nd_mode='flatten'"):
        Muon([torch.zeros(5, 4, 3).transpose(0, 2).requires_grad_()], nd_mode="flatten")


def test_without_the_keys_n_d_params_are_refused_as_torch_refuses_them():
    def error(cls, **kwargs):
        try:
            cls([torch.zeros(2, 3, 4, requires_grad=True)], **kwargs)
        except ValueError as e:
            return str(e)
        return None

    assert error(Muon) == error(torch.optim.Muon) is not None
    assert error(Muon, nd_mode="error") == error(torch.optim.Muon)
    # added later without nd_mode: torch's error at step, and nothing changes
    good = nn.Parameter(torch.ones(4, 3))
    opt = Muon([good], nd_mode="batch")
    opt.add_param_group({"params": [torch.zeros(2, 3, 4, requires_grad=True)], "nd_mode": "error"})
    for p in (good, opt.param_groups[1]["params"][0]):
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="Param gradient must be a 2D matrix"):
        opt.step()
    assert torch.equal(good.detach(), torch.ones(4, 3))


@pytest.mark.parametrize("key,value,message", [
    ("nd_mode", "flat", r"param_groups\[0\]\['nd_mode'\] must be one of"),
    ("algorithm", "fast", r"param_groups\[0\]\['algorithm'\] must be one of"),
    ("split_heads", 4, r"param_groups\[0\]\['split_heads'\] splits the rows of one matrix"),
    ("split_heads", 0, r"param_groups\[0\]\['split_heads'\] must be None or the number of heads"),
])
def test_bad_values_written_into_a_group_later_are_refused_at_step(key, value, message):
    p = nn.Parameter(torch.ones(2, 6, 4))
    w = nn.Parameter(torch.ones(6, 4))
    opt = Muon([p, w], nd_mode="batch")
    p.grad, w.grad = torch.ones_like(p), torch.ones_like(w)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=message):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(2, 6, 4)) and torch.equal(w.detach(), torch.ones(6, 4))
    # a 2-D weight whose rows the split does not divide
    opt = Muon([w], split_heads=2)
    opt.param_groups[0]["split_heads"] = 5
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['split_heads'\] = 5 does not divide the 6 rows"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(6, 4))


# ---------------------------------------------------------------- read at every step
@pytest.mark.parametrize("shape,built,change", [
    ((2, 8, 6), dict(nd_mode="batch"), dict(nd_mode="flatten")),
    ((12, 6), {}, dict(split_heads=3)),
    ((12, 30), {}, dict(algorithm="gram")),
], ids=["nd_mode", "split_heads", "algorithm"])
def test_a_key_changed_between_steps_takes_effect_at_the_next(shape, built, change):
    start = _start(shape, 50).float()

    def run(changed_in_place: dict, built_with: dict):
        p = nn.Parameter(start.clone())
        opt = Muon([{"params": [p], **built_with}], lr=0.02, fp32_matmul_prec="highest", **built)
        _step(opt, [p], 0)
        opt.param_groups[0].update(changed_in_place)
        _step(opt, [p], 1)
        return p.detach(), opt

    changed, opt = run(change, {})
    built_changed, _ = run({}, change)  # the value from the start: the first step differs
    unchanged, _ = run({}, {})
    # the second step of `changed` is the second step of an optimizer that had the value, after the
    # first step of one that had not: replay it from a checkpoint
    p = nn.Parameter(start.clone())
    first = Muon([p], lr=0.02, fp32_matmul_prec="highest", **built)
    _step(first, [p], 0)
    saved = copy.deepcopy(first.state_dict())
    saved["param_groups"][0].update(change)
    q = nn.Parameter(p.detach().clone())
    second = Muon([q], lr=0.02, fp32_matmul_prec="highest", **built)
    second.load_state_dict(saved)
    _step(second, [q], 1)
    assert torch.equal(changed, q.detach())
    if "algorithm" in change:  # gram and standard agree within rounding: the plan says which ran
        assert {stack.config.algorithm for stack in opt._plan.stacks} == {"gram"}
        assert rel(changed - start, unchanged - start) < FP32_VS_FLOAT64
    else:
        assert rel(changed - start, unchanged - start) > 1e-3
        assert rel(built_changed - start, changed - start) > 1e-3


def test_compiled_step_fullgraph_matches_eager():
    params = _extended_model_params(60)
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    eager = Muon(_extended_groups(params), lr=torch.tensor(0.02))
    compiled = Muon(_extended_groups(twins), lr=torch.tensor(0.02))
    step = torch.compile(compiled.step, fullgraph=True, backend="eager")
    for s in range(2):
        g = torch.Generator().manual_seed(s)
        for p, q in zip(params, twins):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        eager.step()
        step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- muon_param_groups
class TinyNet(nn.Module):
    def __init__(self, vocab=20, d=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.norm = nn.LayerNorm(d)
        self.attn_qkv = nn.Linear(d, 3 * d)
        self.mlp = nn.Linear(d, 2 * d, bias=False)
        self.frozen = nn.Linear(2 * d, d, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, idx):
        x = self.embed(idx)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        x = self.norm(x)
        x = self.attn_qkv(x)[..., : x.shape[-1]]
        x = self.frozen(torch.relu(self.mlp(x)))
        return self.lm_head(x)


def _names(model, params):
    ids = {id(p) for p in params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_muon_param_groups_uses_build_optimizers_rules_and_prints_its_table(capsys):
    model = TinyNet()
    muon, other = muon_param_groups(model, verbose=True)
    assert _names(model, muon) == ["attn_qkv.weight", "mlp.weight"]
    assert _names(model, other) == ["embed.weight", "conv.weight", "conv.bias", "norm.weight", "norm.bias",
                                    "attn_qkv.bias"]
    table, _ = route_parameters(model)
    assert capsys.readouterr().out == table.format() + "\n"
    (muon_opt, adamw), built_table = build_optimizers(model)
    assert [p for g in muon_opt.param_groups for p in g["params"]] == muon
    assert {id(p) for g in adamw.param_groups for p in g["params"]} == {id(p) for p in other}
    assert built_table.format() == table.format()
    # named parameters, a generator, work too and are read once
    again = muon_param_groups(model.named_parameters())
    assert [[id(p) for p in params] for params in again] == [[id(p) for p in muon], [id(p) for p in other]]


@pytest.mark.parametrize("muon_cls", [torch.optim.Muon, Muon], ids=["torch", "ours"])
def test_muon_param_groups_trains_with_muon_and_adamw(muon_cls):
    torch.manual_seed(0)
    model = TinyNet()
    muon, other = muon_param_groups(model)
    optimizers = [muon_cls(muon, lr=0.02), torch.optim.AdamW(other, lr=1e-3)]
    idx = torch.randint(0, 20, (2, 5))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(2):
        loss = model(idx).square().mean()
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {n for n, p in model.named_parameters() if p.requires_grad}


def test_muon_param_groups_with_nd_mode_sends_n_d_tensors_to_muon():
    model = TinyNet()
    muon, other = muon_param_groups(model, nd_mode="flatten")
    assert _names(model, muon) == ["conv.weight", "attn_qkv.weight", "mlp.weight"]
    assert "conv.weight" not in _names(model, other)
    table, _ = route_parameters(model, nd_mode="flatten")
    assert table["conv.weight"].reason == "3-D tensor (nd_mode='flatten')"
    opt = Muon(muon, lr=0.02, nd_mode="flatten")
    model(torch.randint(0, 20, (2, 5))).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="nd_mode must be one of"):
        muon_param_groups(model, nd_mode="flat")
