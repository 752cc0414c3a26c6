"""The Gram Newton–Schulz iteration (algorithm="gram", docs/design.md §4.4) and the "auto" choice.

Every result is compared with the float64 *standard* iteration (reference.newton_schulz_ref) at
the tolerances of docs/design.md §9; inputs the standard fp32 iteration itself cannot meet those on
(rank-deficient ones) are compared with that iteration's own error instead.
"""

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.newton_schulz import COEFFICIENT_SETS
from reference import (TOLERANCE, bf16_input_tolerance, newton_schulz_ref, ns_tolerance, on_a_side_stream, op_raises,
                       rel_err)

SHAPES = [(1, 64), (64, 1), (97, 37), (37, 97), (48, 48), (3, 97, 37), (1, 20, 50), (4, 33, 33), (2, 120, 40)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ALL_SETS = list(COEFFICIENT_SETS)


def _input(shape, gen, device):
    return torch.randn(shape, generator=gen).to(device)


def _steps(coefficient_type):
    # deepseekv4 is defined over 10 steps; run it whole (its restarts then differ from 5-step sets).
    return 10 if coefficient_type == "deepseekv4" else 5


# ------------------------------------------------------------------ parity with float64 standard
NEAR_SINGULAR_FP32_TOLERANCE = 1e-4


def _near_singular_square(x):
    """A square input whose smallest singular value is below 1e-4 of its Frobenius norm."""
    if x.shape[-1] != x.shape[-2]:
        return False
    x = x.detach().cpu().double()
    return bool((torch.linalg.svdvals(x).amin(dim=-1) < 1e-4 * x.norm(dim=(-2, -1))).any())


def _assert_gram_accurate(x, out, precision, device, coefficient_type, steps, tol=None):
    """The Gram result within the first-order tolerance of the float64 standard iteration, or, past
    it, within 2.5x of the standard iteration's own error at the same precision on the same input:
    the Gram iteration rounds more often (restarts, the Q products), as on the hard spectra below.
    Seen past the first-order figure: deepseekv4's 10 fp32 steps on (2, 120, 40), 1.25e-5 against
    1e-5 (seed 213087819); cans on a rank-1 (1, 64) input, 1.43e-2 against 1.25e-2 (seed 2195116093);
    deepseekv4 in bf16 (one rounding per restart), 4.3e-2 against 3.9e-2 (seed 213087819)."""
    ref = newton_schulz_ref(x.cpu(), steps=steps, coefficient_type=coefficient_type)
    err = rel_err(out.cpu(), ref)
    if tol is None:
        tol = ns_tolerance(x, precision, device, coefficient_type, steps)
        if steps > 5 and _near_singular_square(x):
            # deepseekv4's 10 steps carry fp32 rounding along the near-null direction (the bf16 limit
            # of docs/limits.md, smaller): over 3,000 CPU draws at 48 x 48 and 4 x 33 x 33, those
            # inputs reached 3.3e-5 (Gram) and 2.7e-5 (standard) from float64
            tol = max(tol, NEAR_SINGULAR_FP32_TOLERANCE)
    if err > tol:
        standard = me.newton_schulz(x, steps=steps, coefficient_type=coefficient_type, precision=precision,
                                    algorithm="standard")
        assert err <= 2.5 * max(tol, rel_err(standard.cpu(), ref)), (err, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", ALL_SETS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision", ["highest", "high"])
def test_gram_fp32_and_high_match_float64_standard(device, coefficient_type, shape, precision, gen):
    # "highest" is fp32; a CPU computes "high" in fp32 too, CUDA in TF32, where the Gram iteration
    # restarts at every step.
    x = _input(shape, gen, device)
    steps = _steps(coefficient_type)
    out = me.newton_schulz(x, steps=steps, coefficient_type=coefficient_type, precision=precision, algorithm="gram")
    assert out.dtype == torch.float32 and out.shape == x.shape and out.device == x.device
    _assert_gram_accurate(x, out, precision, device, coefficient_type, steps)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", ALL_SETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_bf16_matches_float64_standard(device, coefficient_type, shape, gen):
    # "medium": W rounded to bf16 (at the start and at each restart), R and Q in fp32. cans maps
    # sigma = 1 to 1.99 with slope 26, so on a rank-1 input (sigma exactly 1) one bf16 rounding
    # grows by 5e4 over five steps: every algorithm diverges there in bf16 (tested in fp32 above).
    if coefficient_type == "cans" and 1 in shape[-2:]:
        pytest.skip("cans diverges in bf16 on rank-1 inputs, for every algorithm")
    x = _input(shape, gen, device)
    steps = _steps(coefficient_type)
    out = me.newton_schulz(x, steps=steps, coefficient_type=coefficient_type, precision="medium", algorithm="gram")
    if steps > 5 and shape[-1] == shape[-2]:
        # Known limit (docs/limits.md): over deepseekv4's 10 steps, a square input with a near-zero singular
        # value (about 1 draw in 400 at 48 x 48) carries its bf16 rounding of W along that direction,
        # where an error in R weighs 1/sigma^2: up to 29% from float64 over 6,000 draws.
        ref = newton_schulz_ref(x.cpu(), steps=steps, coefficient_type=coefficient_type)
        assert rel_err(out.cpu(), ref) <= max(bf16_input_tolerance(x, coefficient_type, steps), 0.4)
        return
    _assert_gram_accurate(x, out, "medium", device, coefficient_type, steps,
                          tol=bf16_input_tolerance(x, coefficient_type, steps))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_bf16_quintic_within_design_tolerance(device, shape, gen):
    # The default schedule in bf16: within docs/design.md §9's 2e-2 of float64 on every shape, as the
    # standard bf16 iteration is (test_newton_schulz.test_bf16_close_to_exact_for_quintic).
    x = _input(shape, gen, device)
    out = me.newton_schulz(x, precision="medium", algorithm="gram")
    assert rel_err(out.cpu(), newton_schulz_ref(x.cpu())) <= TOLERANCE["medium"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", ["quintic", "polar_express", "cans"])
def test_gram_past_the_table_and_custom(device, coefficient_type, gen):
    steps = len(COEFFICIENT_SETS[coefficient_type]) + 3
    x = _input((2, 30, 70), gen, device)
    out = me.newton_schulz(x, steps=steps, coefficient_type=coefficient_type, precision="highest", algorithm="gram")
    # Past their tables schedules magnify fp32 rounding (test_newton_schulz): compare with the
    # standard iteration in fp32, the same recipe.
    ref = newton_schulz_ref(x.cpu(), steps=steps, coefficient_type=coefficient_type, dtype=torch.float32)
    assert rel_err(out.cpu(), ref) <= 4 * TOLERANCE["highest"]
    rows = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    out = me.newton_schulz(x, steps=7, coefficient_type="custom", custom_coefficient_sets=rows, precision="highest",
                           algorithm="gram")
    ref = newton_schulz_ref(x.cpu(), steps=7, coefficient_type="custom", custom=rows)
    assert rel_err(out.cpu(), ref) <= ns_tolerance(x, "highest", device, "custom", 7, rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_gram_short_schedules(device, steps, gen):
    x = _input((3, 16, 40), gen, device)
    out = me.newton_schulz(x, steps=steps, precision="highest", algorithm="gram")
    ref = newton_schulz_ref(x.cpu(), steps=steps)
    assert rel_err(out.cpu(), ref) <= ns_tolerance(x, "highest", device, "quintic", steps)


# ------------------------------------------------------------------ hard spectra
def _hard_inputs(gen):
    """Rank-deficient (wide and tall) and log-spectrum (1 .. 1e-6, 1 .. 1e-3) matrices: where the
    Gram matrix squares the condition number the iteration sees."""
    wide_rank4 = torch.randn(2, 48, 4, generator=gen) @ torch.randn(2, 4, 160, generator=gen)
    tall_rank3 = torch.randn(150, 3, generator=gen) @ torch.randn(3, 50, generator=gen)
    U, _ = torch.linalg.qr(torch.randn(160, 48, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen, dtype=torch.float64))
    log6 = (U @ torch.diag(torch.logspace(0, -6, 48, dtype=torch.float64)) @ V.T).float()
    log3 = (U @ torch.diag(torch.logspace(0, -3, 48, dtype=torch.float64)) @ V.T).float().T.contiguous()
    return {"wide_rank4": wide_rank4, "tall_rank3": tall_rank3, "log6": log6, "log3": log3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", ALL_SETS)
def test_gram_fp32_on_hard_spectra_is_as_accurate_as_standard(device, coefficient_type, gen):
    # The standard fp32 iteration misses the §9 tolerance on rank-deficient inputs itself (the
    # rounding noise in the null space grows with the schedule); there the Gram iteration's error
    # must stay within 2.5x of the standard's, elsewhere within the tolerance (an H100 measured
    # 2.0x on a rank-3 150 x 50 input, where the CPU stays under 2x).
    steps = _steps(coefficient_type)
    for name, x in _hard_inputs(gen).items():
        x = x.to(device)
        ref = newton_schulz_ref(x.cpu(), steps=steps, coefficient_type=coefficient_type)
        kwargs = dict(steps=steps, coefficient_type=coefficient_type, precision="highest")
        standard = rel_err(me.newton_schulz(x, algorithm="standard", **kwargs).cpu(), ref)
        gram = rel_err(me.newton_schulz(x, algorithm="gram", **kwargs).cpu(), ref)
        tol = ns_tolerance(x, "highest", device, coefficient_type, steps)
        assert gram <= 2.5 * max(tol, standard), (name, gram, standard, tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", ["simple", "quintic", "polar_express", "aol"])
def test_gram_bf16_on_hard_spectra_is_as_accurate_as_standard(device, coefficient_type, gen):
    for name, x in _hard_inputs(gen).items():
        x = x.to(device)
        ref = newton_schulz_ref(x.cpu(), coefficient_type=coefficient_type)
        kwargs = dict(coefficient_type=coefficient_type, precision="medium")
        standard = rel_err(me.newton_schulz(x, algorithm="standard", **kwargs).cpu(), ref)
        gram = rel_err(me.newton_schulz(x, algorithm="gram", **kwargs).cpu(), ref)
        assert gram <= 1.5 * max(TOLERANCE["medium"], standard), (name, gram, standard)


# ------------------------------------------------------------------ auto
# (shape, what auto runs on a CPU): rectangular enough and large enough for Gram to save time.
AUTO_CPU = [((128, 512), "gram"), ((512, 128), "gram"), ((2, 128, 384), "gram"), ((48, 48), "standard"),
            ((64, 256), "standard"), ((128, 192), "standard"), ((97, 37), "standard")]


# "medium" with bf16 GEMMs: the standard iteration's bf16 GEMMs against the Gram iteration's fp32
# products (it needs R with an fp32 result, 2.5x the cost): standard at every shape. With fp32
# GEMMs of bf16 values (a CPU without bf16 instructions) both cost the same: as "highest".
AUTO_CPU_MEDIUM = [(shape, "standard") for shape, _ in AUTO_CPU]


@pytest.mark.parametrize(
    "precision,products,shape,expected",
    [("highest", "auto", *case) for case in AUTO_CPU]
    + [("medium", "bf16", *case) for case in AUTO_CPU_MEDIUM]
    + [("medium", "fp32", *case) for case in AUTO_CPU],
)
def test_auto_picks_by_shape_on_cpu(shape, expected, precision, products, gen):
    me.set_cpu_bf16_products(products)
    try:
        speedup = me.cpu_product_plan(min(shape[-2:]))["bf16_speedup"]
        if precision == "medium" and products == "bf16" and speedup < 1.5:
            # The rule weighs the Gram iteration's fp32 products by the measured speedup of bf16
            # GEMMs (2x to 2.7x on the idle AMX Xeon); a busy machine can measure them barely
            # faster, or slower (then 1), and the Gram shapes here sit near the rule's threshold.
            pytest.skip(f"this process measured bf16 GEMMs only {speedup:.2f}x as fast as fp32 ones")
        x = _input(shape, gen, "cpu")
        auto = me.newton_schulz(x, precision=precision)
        assert torch.equal(auto, me.newton_schulz(x, precision=precision, algorithm=expected))
        other = "standard" if expected == "gram" else "gram"
        assert not torch.equal(auto, me.newton_schulz(x, precision=precision, algorithm=other))
    finally:
        me.set_cpu_bf16_products("auto")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", ALL_SETS)
@pytest.mark.parametrize("shape", [(128, 512), (512, 128), (2, 128, 384), (48, 48), (97, 37)])
def test_auto_meets_the_standard_tolerances(device, coefficient_type, shape, gen):
    x = _input(shape, gen, device)
    steps = _steps(coefficient_type)
    ref = newton_schulz_ref(x.cpu(), steps=steps, coefficient_type=coefficient_type)
    out = me.newton_schulz(x, steps=steps, coefficient_type=coefficient_type, precision="highest")
    assert rel_err(out.cpu(), ref) <= ns_tolerance(x, "highest", device, coefficient_type, steps)
    if coefficient_type != "cans":  # see test_gram_bf16_matches_float64_standard
        out = me.newton_schulz(x, steps=steps, coefficient_type=coefficient_type, precision="medium")
        bf16_ref = newton_schulz_ref(x.cpu(), steps=steps, coefficient_type=coefficient_type, dtype=torch.bfloat16)
        # The standard bf16 recipe's own distance from float64 is what §9 allows it; a bf16
        # iteration rounding at other points (the CPU's P = c G^2 + b G + a I, rounded once) lands
        # within 2x of it (polar_express on 128 x 512: 1.9% mean against the recipe's 1.3%).
        allowed = max(TOLERANCE["medium"], bf16_input_tolerance(x.cpu(), coefficient_type, steps),
                      2.0 * rel_err(bf16_ref, ref))
        if device == "cpu" and steps > 5 and shape[-1] == shape[-2]:
            # Known limit (docs/limits.md): over deepseekv4's 10 steps, P's bf16 diagonal rounding on a
            # square input with a near-zero singular value (about 1 draw in 200 at 48 x 48) grows
            # along that direction: up to 26% from float64 where the recipe stays at 1.3%. One such
            # direction turned fully around is 2 / sqrt(48) = 0.29 of the result's norm; the bound
            # leaves room for the rest of the rounding on top.
            allowed = max(allowed, 0.35)
        assert rel_err(out.cpu(), ref) <= allowed


# ------------------------------------------------------------------ layouts and edge cases
@pytest.mark.parametrize("device", DEVICES)
def test_gram_batch_equals_each_matrix(device, gen):
    x = _input((4, 24, 72), gen, device)
    batched = me.newton_schulz(x, precision="highest", algorithm="gram")
    for i in range(4):
        single = me.newton_schulz(x[i], precision="highest", algorithm="gram")
        assert rel_err(batched[i].cpu(), single.cpu()) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,transpose", [((20, 50), True), ((50, 20), False), ((3, 40, 16), False)])
def test_gram_forced_transpose(device, shape, transpose, gen):
    # The Gram side is then the long one: R is rank-deficient, the hard case restarts handle.
    x = _input(shape, gen, device)
    out = me.newton_schulz(x, transpose=transpose, precision="highest", algorithm="gram")
    ref = newton_schulz_ref(x.cpu(), transpose=transpose)
    standard = rel_err(me.newton_schulz(x, transpose=transpose, precision="highest", algorithm="standard").cpu(), ref)
    assert rel_err(out.cpu(), ref) <= 2 * max(TOLERANCE["highest"], standard)


@pytest.mark.parametrize("device", DEVICES)
def test_gram_noncontiguous_input(device, gen):
    x = _input((90, 30), gen, device).t()  # (30, 90) view
    out = me.newton_schulz(x, precision="highest", algorithm="gram")
    assert out.is_contiguous()
    assert rel_err(out.cpu(), newton_schulz_ref(x.cpu().contiguous())) <= TOLERANCE["highest"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["medium", "highest"])
def test_gram_zero_and_tiny_inputs_stay_finite(device, precision):
    x = torch.zeros(2, 8, 20, device=device)
    x[1] = 1e-30
    out = me.newton_schulz(x, precision=precision, algorithm="gram")
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0


@pytest.mark.parametrize("algorithm", ["gram", "standard", "auto"])
def test_empty_inputs(algorithm):
    assert me.newton_schulz(torch.empty(0, 4, 5), algorithm=algorithm).shape == (0, 4, 5)
    assert me.newton_schulz(torch.empty(4, 0), algorithm=algorithm).shape == (4, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_list_and_split_pass_the_algorithm(device, gen):
    xs = [_input(s, gen, device) for s in [(16, 48), (48, 16), (16, 48)]]
    outs = me.newton_schulz_list(xs, precision="highest", algorithm="gram")
    for x, out in zip(xs, outs):
        single = me.newton_schulz(x, precision="highest", algorithm="gram")
        if device == "cpu":
            assert torch.equal(out, single)
        else:
            # cuBLAS may run a batch of two with another kernel (other summation order) than one
            # matrix: same math within fp32 rounding, not the same bits.
            assert rel_err(out, single) <= ns_tolerance(x, "highest", device)
    # A GPT-2-like QKV split (parts of 4 groups x 8 rows of a 96-column matrix): each part the
    # Gram iteration of its own (32, 96) matrix.
    x = _input((4 * 24, 96), gen, device)
    split = me.newton_schulz_split(x, [8, 8, 8], 4, precision="highest", scale_mode=None, algorithm="gram")
    parts = x.view(4, 24, 96).split(8, dim=1)
    for k, part in enumerate(parts):
        expected = me.newton_schulz(part.reshape(32, 96), precision="highest", algorithm="gram")
        got = split.view(4, 24, 96)[:, 8 * k: 8 * (k + 1)].reshape(32, 96)
        if device == "cpu":
            assert torch.equal(got, expected)
        else:  # batched and single GEMMs may sum in other orders on cuBLAS (see above)
            assert rel_err(got, expected) <= ns_tolerance(part.reshape(32, 96), "highest", device)
    standard = me.newton_schulz_split(x, [8, 8, 8], 4, precision="highest", scale_mode=None, algorithm="standard")
    assert not torch.equal(split, standard)
    assert rel_err(split.cpu(), standard.cpu()) <= 1e-5


# ------------------------------------------------------------------ bad input
def test_bad_algorithm_is_rejected_everywhere_and_changes_nothing():
    x = torch.randn(4, 6)
    before = x.clone()
    match = "algorithm must be one of 'auto', 'standard', 'gram'"
    with pytest.raises(ValueError, match=match):
        me.newton_schulz(x, algorithm="fast")
    with pytest.raises(ValueError, match=match):
        me.newton_schulz_list([x], algorithm="Gram")
    with pytest.raises(ValueError, match=match):
        me.newton_schulz_list([], algorithm="")
    with pytest.raises(ValueError, match=match):
        me.newton_schulz_split(x, [2, 2], 1, algorithm="gram ")
    coeffs = [v for row in COEFFICIENT_SETS["quintic"] for v in row]
    ops = torch.ops.megatron_eopt
    cpp = "algorithm must be one of auto, standard, gram"
    with op_raises(ValueError, cpp):
        ops.newton_schulz(x, coeffs, 5, False, 1e-7, None, "highest", "fast")
    with op_raises(ValueError, cpp):
        ops.newton_schulz_list([x], coeffs, 5, False, 1e-7, None, "highest", "fast")
    with op_raises(ValueError, cpp):
        ops.newton_schulz_split(x, [2, 2], 1, coeffs, 5, False, 1e-7, None, "highest", None, 1.0, "fast")
    assert torch.equal(x, before)


# ------------------------------------------------------------------ opcheck and torch.compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ["gram", "standard", "auto"])
@pytest.mark.parametrize("precision", ["medium", "highest"])
def test_opcheck_algorithm(device, algorithm, precision, gen):
    coeffs = [v for row in COEFFICIENT_SETS["quintic"] for v in row]
    for shape in [(9, 30), (30, 9), (3, 8, 20)]:
        x = torch.randn(shape, generator=gen).to(device)
        torch.library.opcheck(torch.ops.megatron_eopt.newton_schulz.default,
                              (x, coeffs, 5, False, 1e-7, None, precision, algorithm))
    xs = [torch.randn(s, generator=gen).to(device) for s in [(4, 16), (16, 4), (4, 16)]]
    torch.library.opcheck(torch.ops.megatron_eopt.newton_schulz_list.default,
                          (xs, coeffs, 5, False, 1e-7, None, precision, algorithm))
    x = torch.randn(24, 40, generator=gen).to(device)
    torch.library.opcheck(torch.ops.megatron_eopt.newton_schulz_split.default,
                          (x, [4, 2, 2], 3, coeffs, 5, False, 1e-7, None, precision, "spectral", 1.0, algorithm))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_with_algorithm(device, gen):
    def fn(x, y):
        a = me.newton_schulz(x, precision="highest", algorithm="gram")
        b = me.newton_schulz_list([y], precision="highest", algorithm="standard")[0]
        c = me.newton_schulz_split(y, [12, 12], 1, precision="highest", algorithm="auto")
        return a * 2.0, b + c

    x = torch.randn(3, 24, 80, generator=gen).to(device)
    y = torch.randn(24, 80, generator=gen).to(device)
    compiled = torch.compile(fn, fullgraph=True)
    for got, want in zip(compiled(x, y), fn(x, y)):
        torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ CUDA only
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
@pytest.mark.parametrize("shape", [(5, 128, 320), (2, 320, 128), (1, 7, 300), (3, 97, 37)])
def test_cuda_gram_matches_cpu_gram(precision, shape, gen):
    x = torch.randn(shape, generator=gen)
    out = me.newton_schulz(x.cuda(), precision=precision, algorithm="gram").cpu()
    ref = me.newton_schulz(x, precision="highest" if precision == "high" else precision, algorithm="gram")
    tol = {"medium": TOLERANCE["medium"], "high": ns_tolerance(x, "high", "cuda"), "highest": 1e-5}[precision]
    assert rel_err(out, ref) <= tol


@pytest.mark.gpu
def test_cuda_gram_on_current_stream_and_graph_capture(gen):
    x = torch.randn(2, 64, 256, generator=gen).cuda()
    out = on_a_side_stream(lambda: me.newton_schulz(x, precision="highest", algorithm="gram"))
    assert rel_err(out.cpu(), newton_schulz_ref(x.cpu())) <= TOLERANCE["highest"]
    # Capture in a CUDA graph (no host sync, allocations from the graph pool), replay on new data.
    static = x.clone()
    me.newton_schulz(static, precision="medium", algorithm="gram")  # warm-up: cuBLASLt plans
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = me.newton_schulz(static, precision="medium", algorithm="gram")
    static.copy_(torch.randn(2, 64, 256, generator=gen).cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, me.newton_schulz(static, precision="medium", algorithm="gram"))


@pytest.mark.gpu
def test_cuda_gram_is_run_to_run_identical(gen):
    x = torch.randn(3, 200, 600, generator=gen).cuda()
    first = me.newton_schulz(x, precision="highest", algorithm="gram")
    for _ in range(3):
        assert torch.equal(me.newton_schulz(x, precision="highest", algorithm="gram"), first)


@pytest.mark.gpu
def test_cuda_auto_uses_gram_only_for_highest(gen):
    x = torch.randn(1024, 4096, generator=gen).cuda()
    for precision, expected in [("highest", "gram"), ("high", "standard"), ("medium", "standard")]:
        auto = me.newton_schulz(x, precision=precision)
        assert torch.equal(auto, me.newton_schulz(x, precision=precision, algorithm=expected)), precision
