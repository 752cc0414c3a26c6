"""``state_dtype`` of the fused optimizers: bf16 / int8 / fp8 momentum (and AdaMuon's second moment).

The core property: a step with low-memory state computes exactly what the fp32 optimizer computes
from the dequantized state (the step's own values are fp32; only the state carried to the next
step is rounded). So Muon(int8) after k steps equals Muon(fp32) whose momentum was replaced by the
dequantized int8 state before step k, bit for bit. Then: checkpoints convert between state dtypes,
the step compiles, and on a convex problem every format converges as fp32 does.
"""

import copy
import math

import pytest
import torch

from megatron_eopt import low_memory_state as lms
from megatron_eopt.compat.motif import MotifMuon
from megatron_eopt.optim import AdaptiveMuon, HybridMuon, Muon, TensorParallelAdaptiveMuon, TensorParallelMuon
from megatron_eopt.optim import dequantize_state_dict, state_bytes
from reference import rel_err

FORMATS = ["bf16", "int8", "fp8"]
SHAPES = [(16, 24), (40, 8), (1, 300), (300, 1), (97, 37)]


def _params(gen, shapes=SHAPES):
    return [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for s in shapes]


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _set_grads(params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _copy_grads(src, dst):
    for p, q in zip(src, dst):
        q.grad = p.grad.clone()


def _dequantized(state, key):
    scales = state.get(key + "_scales")
    block = state.get("state_block_size", lms.DEFAULT_BLOCK_SIZE)
    moment2_fp8 = key == "moment2_buffer" and state[key].dtype == torch.float8_e4m3fn  # sqrt(v), linear codes
    out = lms.dequantize(state[key], scales, block, linear_fp8=moment2_fp8)
    return out * out if moment2_fp8 else out


MAKERS = {
    "muon": lambda ps, sd: Muon(ps, lr=0.02, weight_decay=0.1, nesterov=True, fp32_matmul_prec="highest",
                                state_dtype=sd),
    "muon_l2": lambda ps, sd: Muon(ps, lr=0.02, weight_decay=0.1, weight_decay_method="l2",
                                   fp32_matmul_prec="highest", state_dtype=sd),
    "adamuon": lambda ps, sd: AdaptiveMuon(ps, 0.02, 0.9, 0.1, moment2_method="adamuon", fp32_matmul_prec="highest",
                                           state_dtype=sd),
    "normuon": lambda ps, sd: AdaptiveMuon(ps, 0.02, 0.9, 0.1, moment2_method="normuon", fp32_matmul_prec="highest",
                                           state_dtype=sd),
    "tp_muon": lambda ps, sd: TensorParallelMuon(ps, lr=0.02, fp32_matmul_prec="highest", state_dtype=sd),
}


@pytest.mark.parametrize("case", list(MAKERS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_step_equals_fp32_step_on_dequantized_state(case, fmt, gen):
    params = _params(gen)
    opt = MAKERS[case](params, fmt)
    ref_params = _clone(params)
    ref = MAKERS[case](ref_params, "fp32")
    keys = ["momentum_buffer"] + (["moment2_buffer"] if case == "adamuon" else [])
    for step in range(4):
        _set_grads(params, gen)
        _copy_grads(params, ref_params)
        if step > 0:  # the fp32 optimizer continues from the dequantized low-memory state
            for p, q in zip(params, ref_params):
                for key in keys:
                    ref.state[q][key] = _dequantized(opt.state[p], key).to(ref.state[q][key].dtype)
                if case == "normuon":
                    ref.state[q]["moment2_buffer"] = opt.state[p]["moment2_buffer"].clone()
        opt.step()
        ref.step()
        for p, q in zip(params, ref_params):
            assert torch.equal(p, q), (case, fmt, step, tuple(p.shape))
    for p in params:
        state = opt.state[p]
        assert state["momentum_buffer"].dtype == lms.momentum_dtype(fmt)
        assert state["momentum_buffer"].shape == p.shape
        if fmt != "bf16":
            assert tuple(state["momentum_buffer_scales"].shape) == lms.scales_shape(p.shape, lms.DEFAULT_BLOCK_SIZE)
        if case == "adamuon":
            assert state["moment2_buffer"].dtype == lms.moment2_dtype(fmt)
        if case == "normuon":
            assert state["moment2_buffer"].dtype == torch.float32  # a vector per matrix: kept fp32


def test_fp32_state_is_the_default_and_unchanged(gen):
    params = _params(gen)
    a, b = Muon(params, lr=0.02), Muon(_clone(params), lr=0.02, state_dtype="fp32")
    _set_grads(params, gen)
    _copy_grads(params, b.param_groups[0]["params"])
    a.step()
    b.step()
    assert a.state_dtype == "fp32"
    for p, q in zip(params, b.param_groups[0]["params"]):
        assert torch.equal(p, q) and a.state[p]["momentum_buffer"].dtype == torch.float32
        assert set(a.state[p]) == {"momentum_buffer"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_dict_round_trip_is_bitwise(fmt, gen):
    params = _params(gen)
    opt = AdaptiveMuon(params, 0.02, 0.9, 0.0, moment2_method="adamuon", state_dtype=fmt)
    for _ in range(2):
        _set_grads(params, gen)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # a checkpoint: load_state_dict keeps references, as torch's does
    twin_params = _clone(params)
    twin = AdaptiveMuon(twin_params, 0.02, 0.9, 0.0, moment2_method="adamuon", state_dtype=fmt)
    twin.load_state_dict(sd)
    for p, q in zip(params, twin_params):
        for key, value in opt.state[p].items():
            other = twin.state[q][key]
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype and torch.equal(other.view(torch.uint8), value.view(torch.uint8))
            else:
                assert other == value
    # The next steps agree bit for bit (the seed travels with the checkpoint).
    _set_grads(params, gen)
    _copy_grads(params, twin_params)
    opt.step()
    twin.step()
    assert all(torch.equal(p, q) for p, q in zip(params, twin_params))


@pytest.mark.parametrize("source", ["fp32", *FORMATS])
@pytest.mark.parametrize("target", ["fp32", *FORMATS])
def test_checkpoints_convert_between_state_dtypes(source, target, gen):
    params = _params(gen)
    opt = AdaptiveMuon(params, 0.02, 0.9, 0.0, moment2_method="adamuon", state_dtype=source)
    for _ in range(2):
        _set_grads(params, gen)
        opt.step()
    values = {key: [_dequantized(opt.state[p], key) for p in params] for key in ("momentum_buffer", "moment2_buffer")}
    target_params = _clone(params)
    other = AdaptiveMuon(target_params, 0.02, 0.9, 0.0, moment2_method="adamuon", state_dtype=target)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    # Values carry over within the target format's rounding to nearest (half a step of its grid).
    for key, tol in (("momentum_buffer", {"fp32": 0, "bf16": 2**-8, "int8": 0.5 / 127, "fp8": 2**-4}),
                     ("moment2_buffer", {"fp32": 0, "bf16": 2**-8, "int8": 2**-3, "fp8": 2**-3})):
        for q, want in zip(target_params, values[key]):
            got = _dequantized(other.state[q], key)
            assert got.dtype == torch.float32 and got.shape == want.shape
            bound = tol[target] * want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            if target in ("bf16",) or (key == "moment2_buffer" and target != "fp32"):
                bound = tol[target] * want.abs() + 1e-12  # relative to each value (floating grids)
            assert ((got - want).abs() <= bound * 1.001 + 1e-12).all(), (key, source, target)
        expected = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
        assert other.state[target_params[0]]["momentum_buffer"].dtype == expected[target]
    _set_grads(target_params, gen)
    other.step()  # and it steps


def test_block_size_travels_with_the_checkpoint(gen):
    params = _params(gen, [(8, 300)])
    opt = Muon(params, lr=0.02, state_dtype="int8", state_block_size=64)
    _set_grads(params, gen)
    opt.step()
    want = _dequantized(opt.state[params[0]], "momentum_buffer")
    q = _clone(params)
    other = Muon(q, lr=0.02, state_dtype="int8")  # blocks of 256: requantized from the values
    other.load_state_dict(opt.state_dict())
    assert other.state[q[0]]["state_block_size"] == 256
    assert other.state[q[0]]["momentum_buffer_scales"].shape == (8, 2)
    got = _dequantized(other.state[q[0]], "momentum_buffer")
    assert ((got - want).abs() <= 0.5 / 127 * want.abs().amax(dim=-1, keepdim=True) * 1.001).all()


def test_bad_checkpoints_are_refused_before_anything_changes(gen):
    params = _params(gen, [(8, 12)])
    opt = Muon(params, lr=0.02, state_dtype="int8")
    _set_grads(params, gen)
    opt.step()
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[params[0]].items()}
    sd = opt.state_dict()
    no_scales = {**sd, "state": {0: {k: v for k, v in sd["state"][0].items() if k != "momentum_buffer_scales"}}}
    with pytest.raises(ValueError, match="momentum_buffer_scales"):
        opt.load_state_dict(no_scales)
    bad_scales = {**sd, "state": {0: {**sd["state"][0], "momentum_buffer_scales": torch.zeros(8, 3)}}}
    with pytest.raises(ValueError, match=r"momentum_buffer_scales.*shape \(8, 3\)"):
        opt.load_state_dict(bad_scales)
    transposed = {**sd, "state": {0: {"momentum_buffer": torch.zeros(12, 8)}}}
    with pytest.raises(ValueError, match=r"momentum_buffer.*shape \(12, 8\)"):
        opt.load_state_dict(transposed)
    for k, v in before.items():
        now = opt.state[params[0]][k]
        assert torch.equal(now, v) if isinstance(v, torch.Tensor) else now == v
    # An fp32 optimizer refuses int8 codes without their scales too, and reads them with them.
    fp32 = Muon(_clone(params), lr=0.02)
    with pytest.raises(ValueError, match="momentum_buffer_scales"):
        fp32.load_state_dict(no_scales)
    fp32.load_state_dict(sd)
    assert fp32.state[fp32.param_groups[0]["params"][0]]["momentum_buffer"].dtype == torch.float32


def test_dequantized_state_dict_loads_into_fp32_peers(gen):
    params = _params(gen, [(8, 12)])
    opt = Muon(params, lr=0.02, state_dtype="fp8")
    _set_grads(params, gen)
    opt.step()
    sd = dequantize_state_dict(opt.state_dict())
    assert set(sd["state"][0]) == {"momentum_buffer"}
    peer = torch.optim.SGD(_clone(params), lr=0.1, momentum=0.9)
    peer.load_state_dict({"state": sd["state"], "param_groups": [{**peer.param_groups[0], "params": [0]}]})
    assert torch.equal(peer.state[peer.param_groups[0]["params"][0]]["momentum_buffer"],
                       _dequantized(opt.state[params[0]], "momentum_buffer"))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_compiled_step_matches_eager(fmt, gen):
    torch._dynamo.reset()
    params = _params(gen, [(16, 24), (40, 8)])
    eager_params = _clone(params)
    opt = AdaptiveMuon(params, 0.02, 0.9, 0.1, moment2_method="adamuon", fp32_matmul_prec="highest", state_dtype=fmt)
    eager = AdaptiveMuon(eager_params, 0.02, 0.9, 0.1, moment2_method="adamuon", fp32_matmul_prec="highest",
                         state_dtype=fmt)
    opt.init_state()
    step = torch.compile(opt.step, fullgraph=True)
    for _ in range(3):
        _set_grads(params, gen)
        _copy_grads(params, eager_params)
        step()
        eager.step()
    for p, q in zip(params, eager_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in ("momentum_buffer", "momentum_buffer_scales"):
            a, b = opt.state[p][key], eager.state[q][key]
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype != torch.float32 else \
                torch.allclose(a, b, rtol=1e-6)


def test_hook_path_refuses_low_memory_state(gen):
    class Custom(Muon):
        def pre_weight_update_fn_inplace(self, p, update):
            pass

    params = _params(gen, [(8, 12)])
    opt = Custom(params, lr=0.02, state_dtype="int8")
    _set_grads(params, gen)
    with pytest.raises(RuntimeError, match="state_dtype='int8'.*pre_weight_update_fn_inplace"):
        opt.step()
    with pytest.raises(ValueError, match="state_dtype"):
        Muon(params, state_dtype="int4")
    with pytest.raises(ValueError, match="state_block_size"):
        Muon(params, state_dtype="int8", state_block_size=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_hybrid_muon_and_offload(fmt, gen):
    shapes = [(16, 24), (8,)]
    params = _params(gen, shapes)
    groups = [{"params": [params[0]], "use_muon": True}, {"params": [params[1]], "use_muon": False}]
    opt = HybridMuon(groups, lr=0.02, state_dtype=fmt, cpu_offload=True)
    for _ in range(2):
        _set_grads(params, gen)
        opt.step()
    opt.turn_off_cpu_offload()
    assert opt.state[params[0]]["momentum_buffer"].dtype == lms.momentum_dtype(fmt)
    assert opt.state[params[1]]["exp_avg"].dtype == torch.float32
    twin_params = _clone(params)
    twin = HybridMuon([{"params": [twin_params[0]], "use_muon": True}, {"params": [twin_params[1]], "use_muon": False}],
                      lr=0.02, state_dtype=fmt)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    a, b = opt.state[params[0]]["momentum_buffer"], twin.state[twin_params[0]]["momentum_buffer"]
    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_state_bytes_per_parameter():
    p = torch.nn.Parameter(torch.zeros(768, 3072))
    sizes = {}
    for fmt in ("fp32", *FORMATS):
        opt = AdaptiveMuon([p], 0.02, 0.9, 0.0, moment2_method="adamuon", state_dtype=fmt)
        opt.init_state()
        sizes[fmt] = state_bytes(opt.state[p]) / p.numel()
    assert sizes["fp32"] == 8.0 and sizes["bf16"] == 4.0
    for fmt in ("int8", "fp8"):
        assert sizes[fmt] == pytest.approx(2 * (1 + 4 / 256))
        assert sizes["fp32"] / sizes[fmt] >= 3.5


@pytest.mark.parametrize("shape", [(256, 64, 3, 3), (256, 128, 1, 1), (64, 3, 5, 5)], ids=str)
def test_convolution_blocks_follow_the_matrix_view_rows(shape, gen):
    # nd_mode="flatten" steps a (out, in, kh, kw) weight as its (out, in * kh * kw) matrix: the blocks
    # run along those rows, so int8 keeps about one byte per value whatever the kernel shape (blocks
    # along the last dim kept 4 / kw extra bytes per value: 5 for 1 x 1 kernels).
    p = torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.1)
    opt = Muon([p], lr=0.02, state_dtype="int8", nd_mode="flatten")
    opt.init_state()
    row = math.prod(shape[1:])
    blocks = math.ceil(row / 256)
    assert tuple(opt.state[p]["momentum_buffer_scales"].shape) == (shape[0], blocks)
    assert state_bytes(opt.state[p]) / p.numel() == pytest.approx(1 + 4 * blocks / row)
    assert state_bytes(opt.state[p]) / p.numel() <= 1.1
    # The step equals the fp32 step on the dequantized state, bit for bit.
    q = torch.nn.Parameter(p.detach().clone())
    ref = Muon([q], lr=0.02, nd_mode="flatten")
    for step in range(2):
        p.grad = torch.randn(shape, generator=gen)
        q.grad = p.grad.clone()
        if step:
            ref.state[q]["momentum_buffer"] = _dequantized(opt.state[p], "momentum_buffer")
        opt.step()
        ref.step()
        assert torch.equal(p, q)


def test_version_1_convolution_checkpoints_convert_to_view_blocks(gen):
    # A version-1 checkpoint kept a convolution's int8 blocks along its last dim (scales shaped
    # (out, in, kh, 1)): it loads as values, stored in blocks along the matrix view's rows.
    shape = (8, 4, 3, 3)
    values = torch.randn(shape, generator=gen)
    codes, scales = lms.quantize(values, torch.int8, 256)  # blocks along the last dim (3 values)
    assert tuple(scales.shape) == (8, 4, 3, 1)
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = Muon([p], lr=0.02, state_dtype="int8", nd_mode="flatten")
    opt.init_state()
    saved = opt.state_dict()
    saved["state"][0] = {"momentum_buffer": codes, "momentum_buffer_scales": scales, "state_block_size": 256,
                         "state_format": torch.tensor(1)}
    opt.load_state_dict(saved)
    state = opt.state[p]
    assert tuple(state["momentum_buffer_scales"].shape) == (8, 1)
    old = lms.dequantize(codes, scales, 256)
    assert rel_err(_dequantized(state, "momentum_buffer"), old) <= 1e-2
    assert int(opt.state_dict()["state"][0]["state_format"]) == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_bitwise_equal_for_any_workspace_budget(fmt, gen):
    # Draws are keyed by each parameter and each element's index in it, not by the launch: one chunk
    # and a chunk per matrix keep bitwise the same state, and the same parameters.
    params = _params(gen)
    others = _clone(params)
    whole = AdaptiveMuon(params, 0.02, 0.9, 0.01, moment2_method="adamuon", state_dtype=fmt, workspace_mib=None)
    chunked = AdaptiveMuon(others, 0.02, 0.9, 0.01, moment2_method="adamuon", state_dtype=fmt,
                           workspace_mib=0.001)
    assert len(chunked._plan.chunks) > 1
    for _ in range(3):
        _set_grads(params, gen)
        _copy_grads(params, others)
        whole.step()
        chunked.step()
    for p, q in zip(params, others):
        assert torch.equal(p, q)
        for key, value in whole.state[p].items():
            other = chunked.state[q][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value,
                                   other.view(torch.uint8) if other.dtype == torch.float8_e4m3fn else other), key


@pytest.mark.parametrize("fmt", ["fp32", *FORMATS])
def test_convex_problem_converges_like_fp32(fmt):
    """0.5·||(W - T) A||² from W = 0 with Muon and a linearly decaying lr: every state format ends
    near the optimum as fp32 does (the loss falls by more than 1e5; a wrong scale or a biased
    rounding that loses the small momentum components stalls far above that)."""
    gen = torch.Generator().manual_seed(1234)
    target = torch.randn(64, 128, generator=gen) * 0.5
    mix = torch.randn(128, 128, generator=gen) / math.sqrt(128)
    w = torch.nn.Parameter(torch.zeros(64, 128))
    steps = 300
    opt = Muon([w], lr=0.02, momentum=0.95, weight_decay=0.0, nesterov=True, fp32_matmul_prec="highest",
               state_dtype=fmt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / steps)
    start = 0.5 * (target @ mix).pow(2).sum().item()
    for _ in range(steps):
        loss = 0.5 * ((w - target) @ mix).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    final = 0.5 * ((w.detach() - target) @ mix).pow(2).sum().item()
    assert final < start * 1e-5, (fmt, start, final)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_small_components_accumulate_unbiased(fmt):
    """A row with one large and many small gradient entries: each step moves the small momentum
    entries by far less than half an int8 / fp8 step of the row's block. Rounding to nearest would
    keep them at zero forever; the stochastic rounding lets their mean follow the exact EMA."""
    g = torch.full((4, 256), 1e-3)
    g[:, 0] = 1.0
    codes, scales = lms.quantize(torch.zeros(4, 256), lms.momentum_dtype(fmt))
    rtn_codes, rtn_scales = codes.clone(), scales.clone()
    exact = torch.zeros(4, 256, dtype=torch.float64)
    for step in range(300):
        lms.foreach_momentum_quantized_([g], [codes], [scales], [torch.empty(4, 256)], momentum=0.95,
                                        nesterov=False, seed=step)
        exact = exact.lerp(g.double(), 0.05)
        # what rounding to nearest would keep
        rtn = lms.dequantize(rtn_codes, rtn_scales).lerp(g, 0.05)
        rtn_codes, rtn_scales = lms.quantize(rtn, lms.momentum_dtype(fmt))
    small = lms.dequantize(codes, scales)[:, 1:].double()
    assert abs(small.mean().item() - exact[0, 1].item()) < 0.1 * exact[0, 1].item()
    if fmt == "int8":  # the biased alternative fails visibly (int8: the small entries never move)
        assert lms.dequantize(rtn_codes, rtn_scales)[:, 1:].abs().max() == 0


# ------------------------------------------------------------------ resuming bit for bit
def _hybrid_groups(ps):
    return [{"params": ps[:-1], "use_muon": True}, {"params": ps[-1:], "use_muon": False}]


RESUMERS = {
    **MAKERS,
    "tp_adamuon": lambda ps, sd: TensorParallelAdaptiveMuon(ps, lr=0.02, moment2_method="adamuon",
                                                            fp32_matmul_prec="highest", state_dtype=sd),
    "hybrid": lambda ps, sd: HybridMuon(_hybrid_groups(ps), lr=0.02, state_dtype=sd),
    "hybrid_adamuon": lambda ps, sd: HybridMuon(_hybrid_groups(ps), lr=0.02, state_dtype=sd,
                                                moment2_method="adamuon"),
    "motif": lambda ps, sd: MotifMuon(_hybrid_groups(ps), lr=0.02, state_dtype=sd),
}
RESUME_SHAPES = [(16, 24), (40, 8), (97, 37), (300, 1)]  # the last one is AdamW's in the hybrids


def _run_steps(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("case", list(RESUMERS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_resumed_run_continues_bit_for_bit(case, fmt, gen):
    params = _params(gen, RESUME_SHAPES)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(5)]
    make = RESUMERS[case]
    opt = make(params, fmt)
    _run_steps(opt, params, grads[:3])
    sd = copy.deepcopy(opt.state_dict())
    assert all(int(entry["state_format"]) == 2 for i, entry in sd["state"].items() if "momentum_buffer" in entry)
    twin_params = _clone(params)  # the model's checkpoint
    resumed = make(twin_params, fmt)
    resumed.load_state_dict(sd)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
        assert "state_seed" not in resumed.state[q] and "state_format" not in resumed.state[q]
    _run_steps(opt, params, grads[3:])
    _run_steps(resumed, twin_params, grads[3:])
    for i, (p, q) in enumerate(zip(params, twin_params)):
        assert torch.equal(p, q), f"{case} {fmt}: param {i} differs after resuming"
        for key, value in opt.state[p].items():
            other = resumed.state[q][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                                   other.view(torch.uint8) if other.element_size() == 1 else other), (case, key)


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_without_seed_restarts_it_at_zero(fmt, gen):
    """A checkpoint written before the seed was saved: the seed restarts at 0, as in a fresh optimizer."""
    params = _params(gen)
    opt = Muon(params, lr=0.02, state_dtype=fmt)
    for _ in range(3):
        _set_grads(params, gen)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    assert {int(entry["state_seed"]) for entry in sd["state"].values()} == {3}
    old = {**sd, "state": {i: {k: v for k, v in e.items() if k not in ("state_seed", "state_format")}
                           for i, e in sd["state"].items()}}
    twin = Muon(_clone(params), lr=0.02, state_dtype=fmt)
    _set_grads(twin.param_groups[0]["params"], gen)
    twin.step()  # its seed moved on: the old checkpoint sets it back to 0
    twin.load_state_dict(old)
    assert [int(s) for s in twin._state_seeds.values()] == [0]
    twin.load_state_dict(sd)
    assert [int(s) for s in twin._state_seeds.values()] == [3]
    twin.load_state_dict({**sd, "state": {i: {**e, "state_seed": 7} for i, e in sd["state"].items()}})  # ints too
    assert [int(s) for s in twin._state_seeds.values()] == [7]


def test_newer_state_format_is_refused_before_anything_changes(gen):
    params = _params(gen, [(8, 12)])
    opt = Muon(params, lr=0.02, state_dtype="fp8")
    _set_grads(params, gen)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    _set_grads(params, gen)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[params[0]].items() if isinstance(v, torch.Tensor)}
    seed = int(opt._state_seeds[torch.device("cpu")])
    for version in (3, torch.tensor(3), 0, "1", 1.0):
        bad = {**sd, "state": {0: {**sd["state"][0], "state_format": version}}}
        for target in (opt, Muon(_clone(params), lr=0.02)):  # fp32 targets read the codes too
            with pytest.raises(ValueError, match=r"state_format.*reads low-memory state formats 1 to 2"):
                target.load_state_dict(bad)
        with pytest.raises(ValueError, match="state_format"):
            dequantize_state_dict(bad)
    for k, v in before.items():
        assert torch.equal(opt.state[params[0]][k].view(torch.uint8) if v.element_size() == 1 else opt.state[params[0]][k],
                           v.view(torch.uint8) if v.element_size() == 1 else v)
    assert int(opt._state_seeds[torch.device("cpu")]) == seed
    # without a version: the current format
    unversioned = {**sd, "state": {0: {k: v for k, v in sd["state"][0].items() if k != "state_format"}}}
    opt.load_state_dict(unversioned)
    assert torch.equal(opt.state[params[0]]["momentum_buffer"].view(torch.uint8),
                       sd["state"][0]["momentum_buffer"].view(torch.uint8))


def test_fp32_state_dict_has_no_resume_entries(gen):
    """fp32 state: the checkpoint is a peer's (Emerging-Optimizers, torch.optim.Muon), both ways."""
    params = _params(gen, [(8, 12)])
    opt = Muon(params, lr=0.02)
    _set_grads(params, gen)
    opt.step()
    assert set(opt.state_dict()["state"][0]) == {"momentum_buffer"}
    low = Muon(_clone(params), lr=0.02, state_dtype="int8")
    low.load_state_dict(opt.state_dict())  # an fp32 checkpoint into low-memory state
    fp32 = Muon(_clone(params), lr=0.02)
    fp32.load_state_dict(low.state_dict())  # and back
    assert set(fp32.state[fp32.param_groups[0]["params"][0]]) == {"momentum_buffer"}
