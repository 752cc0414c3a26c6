"""The low-memory state ops (bf16 / int8 / fp8 momentum, AdaMuon's second moment) against fp32 references.

Each step is checked three ways: the fp32 outputs of the step (Newton–Schulz input, normalized
update) equal the fp32 op run on the dequantized old state, bit for bit; the stored state lies on
one of the two grid neighbours of the exact new value; and over many seeds its mean is the exact
value (unbiased rounding).
"""

import math

import pytest
import torch

from megatron_eopt import low_memory_state as lms
from megatron_eopt import ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SHAPES = [(1, 300), (300, 1), (97, 37), (5, 512), (3, 4, 70)]
FORMATS = ["bf16", "int8", "fp8"]


def _state(x, fmt, block=lms.DEFAULT_BLOCK_SIZE):
    codes, scales = lms.quantize(x, lms.momentum_dtype(fmt), block)
    return codes, scales


def _grid_step(ref: torch.Tensor, fmt: str, scales: torch.Tensor | None, block: int) -> torch.Tensor:
    """Distance between the two grid neighbours of each exact value (the rounding's largest error)."""
    r = ref.double()
    if fmt == "bf16":
        return r.abs() * 2.0**-7 + 1e-45
    blocks, row = lms._blocks(torch.ones_like(ref), block)
    scale = (blocks * scales.reshape(blocks.shape[0], -1, 1)).view(blocks.shape[0], -1)[:, :row].reshape(ref.shape)
    scale = scale.double()
    if fmt == "int8":
        return scale
    y = (r / scale).abs()
    if fmt == "fp8":  # the momentum's squared codes: the grid sqrt(e4m3(c))
        grid = lms._squared_grid("cpu").double()
        i = torch.searchsorted(grid, y.cpu().contiguous(), right=True).clamp(1, len(grid) - 1)
        return (grid[i] - grid[i - 1]).to(y.device) * scale
    # "fp8-linear" (the second moment's sqrt(v)): e4m3 spacing at |y|, 2^(floor(log2 y) - 3), 2^-9 below 2^-6
    e = torch.floor(torch.log2(y.clamp_min(2.0**-6)))
    return 2.0 ** (e - 3) * scale


def _run_momentum(fmt, g, codes, scales, ns, *, mu, nesterov, seed, block=lms.DEFAULT_BLOCK_SIZE, **kw):
    lms.foreach_momentum_quantized_([g], [codes], [] if scales is None else [scales], [ns], momentum=mu,
                                    nesterov=nesterov, block_size=block, seed=seed, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_momentum_step_against_fp32(device, fmt, shape, grad_dtype, gen):
    block = 64 if len(shape) == 3 else lms.DEFAULT_BLOCK_SIZE
    m0 = (torch.randn(shape, generator=gen) * 0.1).to(device)
    g = torch.randn(shape, generator=gen).to(device=device, dtype=grad_dtype)
    p = torch.randn(shape, generator=gen).to(device=device, dtype=grad_dtype)
    codes, scales = _state(m0, fmt, block)
    old = lms.dequantize(codes, scales, block)
    for method, nesterov in (("decoupled", True), ("l2", False)):
        c, s = codes.clone(), None if scales is None else scales.clone()
        ns = torch.empty(shape, device=device)
        _run_momentum(fmt, g, c, s, ns, mu=0.9, nesterov=nesterov, seed=11, block=block, params=[p],
                      weight_decay=0.01, weight_decay_method=method)
        # The fp32 op on the dequantized state: same NS input to the bit, the exact new momentum.
        buf, ns_ref = old.clone(), torch.empty(shape, device=device)
        ops.foreach_momentum_([g], [buf], [ns_ref], [p], momentum=0.9, nesterov=nesterov, weight_decay=0.01,
                              weight_decay_method=method)
        assert torch.equal(ns, ns_ref), f"NS input: {int((ns != ns_ref).sum())} of {ns.numel()} differ ({method})"
        new = lms.dequantize(c, s, block).double()
        if s is not None:  # the block scales are those of the exact new momentum
            want = lms.quantize(buf, lms.momentum_dtype(fmt), block)[1]
            assert torch.equal(s, want), f"scales: {int((s != want).sum())} of {s.numel()} differ ({method})"
        step = _grid_step(buf, fmt, s, block)
        off = (new - buf.double()).abs() > step * 1.0001
        assert not off.any(), f"{int(off.sum())} values beyond one grid step of the exact momentum ({method})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_momentum_rounding_is_unbiased(device, fmt, gen):
    shape = (4, 96)
    g = torch.randn(shape, generator=gen).to(device)
    codes0, scales0 = _state(torch.randn(shape, generator=gen).to(device) * 0.1, fmt)
    old = lms.dequantize(codes0, scales0)
    exact = old.double().lerp(g.double(), 0.1)
    total = torch.zeros(shape, dtype=torch.float64, device=device)
    draws = 400
    for seed in range(draws):
        c, s = codes0.clone(), None if scales0 is None else scales0.clone()
        _run_momentum(fmt, g, c, s, torch.empty(shape, device=device), mu=0.9, nesterov=False, seed=seed)
        total += lms.dequantize(c, s).double()
    mean = total / draws
    step = _grid_step(exact.float(), fmt, None if scales0 is None else lms.quantize(exact.float(),
                      lms.momentum_dtype(fmt))[1], lms.DEFAULT_BLOCK_SIZE)
    # Each draw errs by at most one step, uniformly signed: the mean of 400 is within 4 sigma of exact.
    assert ((mean - exact).abs() <= 4 * step / math.sqrt(draws) + 1e-7).all()
    # Deterministic: the same seed stores the same bits; another seed other bits.
    runs = []
    for seed in (5, 5, 6):
        c, s = codes0.clone(), None if scales0 is None else scales0.clone()
        _run_momentum(fmt, g, c, s, torch.empty(shape, device=device), mu=0.9, nesterov=False, seed=seed)
        runs.append(c.view(torch.uint8) if c.dtype != torch.bfloat16 else c.view(torch.int16))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("device", DEVICES)
def test_zero_nonfinite_and_tiny_blocks(device):
    shape = (3, 256)
    g = torch.zeros(shape, device=device)
    g[1, 7] = float("nan")
    g[2] = 1e-40  # below fp32 normals after the lerp: stored as zeros
    for fmt in ("int8", "fp8"):
        codes, scales = _state(torch.zeros(shape, device=device), fmt)
        ns = torch.empty(shape, device=device)
        _run_momentum(fmt, g, codes, scales, ns, mu=0.5, nesterov=False, seed=1)
        back = lms.dequantize(codes, scales)
        assert torch.equal(back[0], torch.zeros(256, device=device))  # zero block
        assert scales[0, 0] == 0 and torch.isnan(scales[1, 0]) and torch.isnan(back[1]).all()
        assert scales[2, 0] == 0 and torch.equal(back[2], torch.zeros(256, device=device))
        assert torch.isnan(ns[1, 7]) and not torch.isnan(ns[1, :7]).any()  # the step itself is exact
    codes = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    _run_momentum("bf16", g, codes, None, torch.empty(shape, device=device), mu=0.5, nesterov=False, seed=1)
    assert torch.isnan(codes[1, 7]) and not torch.isnan(codes[1, :7]).any()


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_grad_scale_and_strided_inputs(device, gen):
    shape = (40, 24)
    gt = torch.randn(shape[::-1], generator=gen).to(device).t()  # a transposed gradient
    codes, scales = _state(torch.randn(shape, generator=gen).to(device), "int8")
    c0, s0 = codes.clone(), scales.clone()
    ns = torch.zeros(shape, device=device)
    _run_momentum("int8", gt, codes, scales, ns, mu=0.9, nesterov=True, seed=0,
                  found_inf=torch.ones((), device=device))
    assert torch.equal(codes, c0) and torch.equal(scales, s0) and torch.equal(ns, torch.zeros_like(ns))
    # grad_scale divides the gradient; a strided ns_input is written through.
    ns_t = torch.empty(shape[::-1], device=device).t()
    _run_momentum("int8", gt * 4, codes, scales, ns_t, mu=0.9, nesterov=True, seed=0,
                  grad_scale=torch.full((), 4.0, device=device))
    buf, ns_ref = lms.dequantize(c0, s0), torch.empty(shape, device=device)
    ops.foreach_momentum_([gt.contiguous()], [buf], [ns_ref], momentum=0.9, nesterov=True)
    torch.testing.assert_close(ns_t, ns_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("shape", [(1, 300), (300, 1), (97, 37), (5, 512)])
def test_adamuon_second_moment_against_fp32(device, fmt, shape, gen):
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    v0 = torch.rand(shape, generator=gen).to(device) * 1e-3
    stored = v0 if fmt == "bf16" else v0.sqrt()
    codes, scales = lms.quantize(stored, dtype, linear_fp8=True)
    old_stored = lms.dequantize(codes, scales, linear_fp8=True)
    old_v = old_stored if fmt == "bf16" else old_stored * old_stored
    o = torch.randn(shape, generator=gen).to(device) / math.sqrt(max(shape))
    u = o.clone()
    lms.adamuon_normalize_quantized_([u], [codes], [] if scales is None else [scales], beta2=0.95, eps=1e-8, seed=3)
    u_ref, v_ref = o.clone(), old_v.clone()
    ops.adamuon_normalize_([u_ref], [v_ref], beta2=0.95, eps=1e-8)
    assert torch.equal(u, u_ref)
    exact = v_ref if fmt == "bf16" else v_ref.sqrt()
    new = lms.dequantize(codes, scales, linear_fp8=True)
    step = _grid_step(exact, "bf16" if fmt == "bf16" else "fp8-linear", scales, lms.DEFAULT_BLOCK_SIZE)
    assert ((new.double() - exact.double()).abs() <= step * 1.0001).all()


# opcheck's schema test compares tensors by arithmetic torch does not implement for float8 on the
# CPU; the fp8 cases run the other checks, the schema test runs on the int8 and bf16 cases.
def _utils(dtype):
    every = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    return every[1:] if dtype == torch.float8_e4m3fn else every


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, gen):
    shape = (6, 300)
    for fmt in FORMATS:
        g = torch.randn(shape, generator=gen).to(device)
        codes, scales = _state(torch.randn(shape, generator=gen).to(device), fmt)
        sc = [] if scales is None else [scales]
        mu = torch.full((), 0.9, dtype=torch.float64, device=device)
        wd = torch.zeros((), dtype=torch.float64, device=device)
        seed = torch.full((), 4, dtype=torch.int64, device=device)
        torch.library.opcheck(torch.ops.megatron_eopt.foreach_momentum_quantized_.default,
                              ([g], [codes], sc, [torch.empty(shape, device=device)], [], mu, True, wd, "decoupled",
                               256, seed), test_utils=_utils(codes.dtype))
        # with draws: a (6, 300) shard of rows 2..7 of a (12, 300) parameter keyed 5
        torch.library.opcheck(torch.ops.megatron_eopt.foreach_momentum_quantized_.default,
                              ([g], [codes], sc, [torch.empty(shape, device=device)], [], mu, True, wd, "decoupled",
                               256, seed, None, None, [5, 6, 12, 300, 600]), test_utils=_utils(codes.dtype))
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        codes, scales = lms.quantize(torch.rand(shape, generator=gen).to(device), dtype, 128, linear_fp8=True)
        b = torch.full((), 0.95, dtype=torch.float64, device=device)
        e = torch.full((), 1e-8, dtype=torch.float64, device=device)
        seed = torch.zeros((), dtype=torch.int64, device=device)
        torch.library.opcheck(torch.ops.megatron_eopt.adamuon_normalize_quantized_.default,
                              ([torch.randn(shape, generator=gen).to(device)], [codes],
                               [] if scales is None else [scales], b, e, 128, seed), test_utils=_utils(dtype))


def test_bad_arguments_are_refused_before_anything_changes(gen):
    shape = (8, 16)
    g = torch.randn(shape, generator=gen)
    codes, scales = _state(torch.randn(shape, generator=gen), "int8")
    c0, s0 = codes.clone(), scales.clone()
    ns = torch.zeros(shape)

    def call(**overrides):
        args = dict(grads=[g], states=[codes], scales=[scales], ns_inputs=[ns], momentum=0.9, nesterov=False, seed=1)
        args.update(overrides)
        lms.foreach_momentum_quantized_(**args)

    with pytest.raises(TypeError, match=r"states\[0\]"):
        call(states=[torch.zeros(shape)])
    with pytest.raises(ValueError, match=r"scales\[0\]"):
        call(scales=[torch.zeros(8, 2)])
    with pytest.raises(ValueError, match=r"scales has 0 tensors"):
        call(scales=[])
    with pytest.raises(ValueError, match=r"ns_inputs\[0\] has 64 elements"):
        call(ns_inputs=[torch.zeros(8, 8)])
    with pytest.raises(TypeError, match="seed"):
        call(seed=torch.zeros((), dtype=torch.float32))
    with pytest.raises(ValueError, match="block_size"):
        call(block_size=0)
    with pytest.raises(ValueError, match="momentum"):
        call(momentum=-0.5)
    with pytest.raises(ValueError, match=r"contiguous"):
        call(states=[torch.zeros(16, 8, dtype=torch.int8).t()], scales=[torch.zeros(8, 1)])
    with pytest.raises(TypeError, match="moment2"):
        lms.adamuon_normalize_quantized_([torch.zeros(shape)], [torch.zeros(shape, dtype=torch.int8)],
                                         [torch.zeros(8, 1)])
    with pytest.raises(ValueError, match="draws"):
        call(draws=[(0, 8, 8, 16)])  # four values, not five
    for bad in ((0, 3, 8, 16, 0), (0, 8, 4, 16, 0), (0, 8, 8, 15, 0), (0, 8, 8, 16, -1)):
        with pytest.raises(ValueError, match=r"draws of tensor 0"):
            call(draws=[bad])  # local rows not dividing 8, more than the global rows, cols short, base < 0
    assert torch.equal(codes, c0) and torch.equal(scales, s0) and torch.equal(ns, torch.zeros(shape))


def test_quantize_dequantize_round_trip(gen):
    x = torch.randn(7, 300, generator=gen)
    for fmt in ("int8", "fp8"):
        dtype = lms.momentum_dtype(fmt)
        codes, scales = lms.quantize(x, dtype, 128)
        assert codes.dtype == dtype and tuple(scales.shape) == (7, 3)
        back = lms.dequantize(codes, scales, 128)
        # round to nearest: at most half a step
        assert ((back - x).abs() <= _grid_step(x, fmt, scales, 128) * 0.5001).all()
    codes, scales = lms.quantize(x, torch.bfloat16)
    assert scales is None and torch.equal(lms.dequantize(codes, None), x.bfloat16().float())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_stores_the_cpu_bits(fmt, gen):
    """Both backends run the same element math and draws: the same codes, scales and NS inputs."""
    shapes = [(1, 300), (300, 1), (97, 37), (64, 1024)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    states = [_state(torch.randn(s, generator=gen) * 0.1, fmt) for s in shapes]
    results = {}
    for device in ("cpu", "cuda"):
        # Copies on both devices: the CPU run steps its state in place, and the CUDA run must
        # start from the same state, not from the CPU's result.
        codes = [c.to(device, copy=True) for c, _ in states]
        scales = [s.to(device, copy=True) for _, s in states if s is not None]
        ns = [torch.empty(s, device=device) for s in shapes]
        lms.foreach_momentum_quantized_([g.to(device) for g in grads], codes, scales, ns, momentum=0.9, nesterov=True,
                                        seed=torch.full((), 77, dtype=torch.int64, device=device))
        results[device] = ([c.cpu() for c in codes], [s.cpu() for s in scales], [n.cpu() for n in ns])
    def bits(t):
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.uint8) if t.element_size() == 1 \
            else t.view(torch.int32)

    for what, key in (("codes", 0), ("scales", 1), ("NS inputs", 2)):
        for k, (a, b) in enumerate(zip(results["cpu"][key], results["cuda"][key])):
            differ = (bits(a) != bits(b)).flatten().nonzero().flatten()
            assert differ.numel() == 0, (
                f"{what} of tensor {k} {tuple(shapes[k])}: {differ.numel()} of {a.numel()} differ, first at flat "
                f"index {int(differ[0])}: cpu {a.flatten()[differ[0]].item()} cuda {b.flatten()[differ[0]].item()}")


def _momentum_step(grads, codes, scales, device, draws):
    ns = [torch.empty(g.shape, device=device) for g in grads]
    lms.foreach_momentum_quantized_(grads, codes, scales, ns, momentum=0.9, nesterov=True, block_size=128,
                                    seed=torch.full((), 9, dtype=torch.int64, device=device), draws=draws)


def _shards_draw_as_the_whole(fmt, gen, device):
    # A (3, 10, 384) stack of matrices cut into boxes (experts x rows x whole blocks of columns) steps
    # to the same codes and scales as the whole tensor, when each box says where it lies (draws).
    shape = (3, 10, 384)
    grad = torch.randn(shape, generator=gen).to(device)
    codes, scales = _state(torch.randn(shape, generator=gen) * 0.1, fmt, 128)
    codes, scales = codes.to(device), None if scales is None else scales.to(device)
    state, block_scales = codes.clone(), None if scales is None else lms.scales_shape(shape, 128)
    whole = [state.view(30, 384)]
    whole_scales = [] if scales is None else [scales.clone().view(30, 3)]
    _momentum_step([grad.view(30, 384)], whole, whole_scales, device, [lms.draw_layout(4, (3, 10, 384), shape)])
    for e0, e1, r0, r1, c0, c1 in ((0, 2, 0, 7, 0, 256), (2, 3, 3, 10, 128, 384), (1, 3, 0, 10, 256, 384)):
        box = (slice(e0, e1), slice(r0, r1), slice(c0, c1))
        part = codes[box].contiguous()
        part_scales = [] if scales is None else [scales[e0:e1, r0:r1, c0 // 128:c1 // 128].contiguous()]
        local = tuple(part.shape)
        _momentum_step([grad[box].contiguous()], [part], part_scales, device,
                       [lms.draw_layout(4, local, shape, (e0, r0, c0))])
        want = state.view(shape)[box]
        assert torch.equal(part.view(torch.uint8) if part.element_size() == 1 else part,
                           want.view(torch.uint8) if want.element_size() == 1 else want), (fmt, box)
        if scales is not None:
            assert torch.equal(part_scales[0], whole_scales[0].view(block_scales)[e0:e1, r0:r1, c0 // 128:c1 // 128])
    # without draws, a box draws by its own element indices: not the whole tensor's bits
    part = codes[:, :, 128:].contiguous()
    _momentum_step([grad[:, :, 128:].contiguous()], [part], [] if scales is None else
                   [scales[:, :, 1:].contiguous()], device, None)
    assert not torch.equal(part.float(), state.view(shape)[:, :, 128:].float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_with_draws_store_the_whole_tensors_bits(fmt, gen):
    _shards_draw_as_the_whole(fmt, gen, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_shards_with_draws_store_the_whole_tensors_bits(fmt, gen):
    _shards_draw_as_the_whole(fmt, gen, "cuda")
