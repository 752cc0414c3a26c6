import importlib
import subprocess
import sys
import types

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.coefficients import COEFFICIENT_SETS, FIXED_LENGTH_TYPES, get_coefficients
from reference import (TOLERANCE, bf16_input_tolerance, newton_schulz_ref, ns_tolerance, on_a_side_stream, op_raises,
                       rel_err)

SHAPES = [(1, 64), (64, 1), (97, 37), (37, 97), (48, 48), (3, 97, 37), (1, 20, 50), (4, 33, 33)]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _input(shape, gen, device):
    return torch.randn(shape, generator=gen).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", list(COEFFICIENT_SETS))
@pytest.mark.parametrize("shape", SHAPES)
def test_parity_fp32_every_coefficient_set(device, coefficient_type, shape, gen):
    x = _input(shape, gen, device)
    out = me.newton_schulz(x, steps=5, coefficient_type=coefficient_type, precision="highest")
    assert out.dtype == torch.float32 and out.shape == x.shape and out.device == x.device
    ref = newton_schulz_ref(x.cpu(), steps=5, coefficient_type=coefficient_type)
    assert rel_err(out.cpu(), ref) <= ns_tolerance(x, "highest", device, coefficient_type)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coefficient_type", sorted(set(COEFFICIENT_SETS) - FIXED_LENGTH_TYPES))
def test_schedules_run_past_their_table(device, coefficient_type, gen):
    # Past its table a schedule re-applies rows tuned for small singular values (cycle) to a
    # spectrum already near 1, which amplifies the rounding of fp32 itself: compared with float64,
    # the fp32 reference recipe lands up to 7e-6 away (quintic) and, for cans, whose rows are the
    # steepest, up to 2.5e-5 (600 seeds; ours up to 2.9e-5 over 4,000), so cans gets 5e-5, and any
    # schedule three times the fp32 recipe's own distance on this input where that is larger.
    steps = len(COEFFICIENT_SETS[coefficient_type]) + 2
    x = _input((3, 40, 24), gen, device)
    out = me.newton_schulz(x, steps=steps, coefficient_type=coefficient_type, precision="highest")
    ref = newton_schulz_ref(x.cpu().double(), steps=steps, coefficient_type=coefficient_type, dtype=torch.float64)
    recipe = newton_schulz_ref(x.cpu(), steps=steps, coefficient_type=coefficient_type, dtype=torch.float32)
    floor = 5e-5 if coefficient_type == "cans" else TOLERANCE["highest"]
    assert rel_err(out.cpu().double(), ref) <= max(floor, 3 * rel_err(recipe.double(), ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["medium", "high"])
@pytest.mark.parametrize("coefficient_type", ["simple", "quintic", "polar_express", "aol", "deepseekv4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_parity_reduced_precision(device, precision, coefficient_type, shape, gen):
    # cans diverges in bf16 on rank-1 inputs by construction (first row 8.47, -25.1, 18.6):
    # tested in fp32 above. bf16 ("medium") is compared with the reference recipe in bf16: bf16
    # storage alone moves a 5-step result 1-6% from the exact one, the reference packages' too,
    # and two bf16 implementations (fp32 sums in another order) round some entries the other way,
    # which the iteration magnifies like any rounding (bf16_input_tolerance).
    # TF32 ("high") is compared with float64 at the tolerance its rounding allows (ns_tolerance).
    # On the CPU, "medium" runs bf16 GEMMs and forms P = c G^2 + b G + a I in one pass (rounded
    # once), where the recipe fuses each step's scalars into its products: compared with float64,
    # at docs/design.md §9's bf16 tolerance, the input's bf16 amplification (aol and steep schedules on rank-1
    # inputs), or within 1.25x of the bf16 recipe's own error, whichever is largest (over 2,400
    # draws: at most 0.77 of this bound).
    x = _input(shape, gen, device)
    out = me.newton_schulz(x, coefficient_type=coefficient_type, precision=precision)
    if precision == "medium" and device == "cpu":
        exact = newton_schulz_ref(x, coefficient_type=coefficient_type)
        recipe = newton_schulz_ref(x, coefficient_type=coefficient_type, dtype=torch.bfloat16)
        bound = max(TOLERANCE["medium"], bf16_input_tolerance(x, coefficient_type), 1.25 * rel_err(recipe, exact))
        assert rel_err(out, exact) <= bound
        return
    if precision == "medium":
        ref = newton_schulz_ref(x.cpu(), coefficient_type=coefficient_type, dtype=torch.bfloat16)
        tol = bf16_input_tolerance(x, coefficient_type)
    else:
        ref = newton_schulz_ref(x.cpu(), coefficient_type=coefficient_type)
        tol = ns_tolerance(x, precision, device, coefficient_type)
    assert rel_err(out.cpu(), ref) <= tol


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_close_to_exact_for_quintic(device, shape, gen):
    x = _input(shape, gen, device)
    out = me.newton_schulz(x, precision="medium")
    assert rel_err(out.cpu(), newton_schulz_ref(x.cpu())) <= TOLERANCE["medium"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,transpose", [((20, 50), True), ((50, 20), False), ((3, 40, 16), False)])
def test_forced_transpose(device, shape, transpose, gen):
    x = _input(shape, gen, device)
    out = me.newton_schulz(x, transpose=transpose, precision="highest")
    ref = newton_schulz_ref(x.cpu(), transpose=transpose)
    assert rel_err(out.cpu(), ref) <= TOLERANCE["highest"]


@pytest.mark.parametrize("device", DEVICES)
def test_custom_coefficients_cycle(device, gen):
    rows = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    x = _input((30, 70), gen, device)
    out = me.newton_schulz(x, steps=5, coefficient_type="custom", custom_coefficient_sets=rows, precision="highest")
    ref = newton_schulz_ref(x.cpu(), steps=5, coefficient_type="custom", custom=rows)
    assert rel_err(out.cpu(), ref) <= TOLERANCE["highest"]


@pytest.mark.parametrize("device", DEVICES)
def test_result_is_nearly_orthogonal(device, gen):
    x = _input((64, 256), gen, device)
    out = me.newton_schulz(x, steps=10, coefficient_type="polar_express", precision="highest").cpu()
    s = torch.linalg.svdvals(out.double())
    assert float(s.min()) > 0.8 and float(s.max()) < 1.2


@pytest.mark.parametrize("device", DEVICES)
def test_zero_and_tiny_inputs_stay_finite(device):
    x = torch.zeros(2, 8, 5, device=device)
    x[1] = 1e-30
    out = me.newton_schulz(x, precision="highest")
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_noncontiguous_input(device, gen):
    x = _input((40, 30), gen, device).t()  # (30, 40) view
    out = me.newton_schulz(x, precision="highest")
    ref = newton_schulz_ref(x.cpu().contiguous())
    assert rel_err(out.cpu(), ref) <= TOLERANCE["highest"]


def test_empty_inputs():
    assert me.newton_schulz(torch.empty(0, 4, 5)).shape == (0, 4, 5)
    assert me.newton_schulz(torch.empty(4, 0)).shape == (4, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_list_form_equals_per_matrix_calls(device, gen):
    shapes = [(16, 24), (7, 3), (16, 24), (1, 9), (24, 16), (7, 3), (16, 24)]
    xs = [_input(s, gen, device) for s in shapes]
    outs = me.newton_schulz_list(xs, precision="highest")
    assert len(outs) == len(xs)
    for x, out in zip(xs, outs):
        single = me.newton_schulz(x, precision="highest")
        assert out.shape == x.shape
        # Batched and single GEMMs may sum in other orders (cuBLAS picks kernels per batch size):
        # fp32 rounding, as amplified by the iteration (an H100 measured 1.3e-6 on a (7, 3) input).
        assert rel_err(out.cpu(), single.cpu()) <= ns_tolerance(x, "highest", device)
    assert me.newton_schulz_list([]) == []


def test_coefficient_schedules():
    assert get_coefficients("quintic", 7)[5:] == [COEFFICIENT_SETS["quintic"][0], COEFFICIENT_SETS["quintic"][1]]
    assert get_coefficients("cans", 7)[5:] == [COEFFICIENT_SETS["cans"][-1]] * 2
    assert get_coefficients("polar_express", 10)[8:] == [COEFFICIENT_SETS["polar_express"][-1]] * 2
    assert get_coefficients("deepseekv4", 12)[10:] == [(2.0, -1.5, 0.5)] * 2
    assert get_coefficients("aol", 5)[4] == COEFFICIENT_SETS["aol"][0]
    assert me.get_supported_coefficient_types() == [
        "simple", "quintic", "polar_express", "cans", "aol", "deepseekv4", "cubic5", "custom"]
    me.validate_coefficient_type("cans")


def test_scale_factors():
    assert me.get_muon_scale_factor(1024, 4096) == 64.0
    assert me.get_muon_scale_factor(4096, 1024, "shape_scaling") == 2.0
    assert me.get_muon_scale_factor(1024, 4096, "shape_scaling") == 1.0
    assert me.get_muon_scale_factor(1024, 4096, "unit_rms_norm") == 0.5
    with pytest.raises(ValueError, match="scale_mode"):
        me.get_muon_scale_factor(4, 4, "rms")


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(coefficient_type="cubic"), ValueError, "coefficient_type must be one of"),
        (dict(coefficient_type="custom"), ValueError, "custom_coefficient_sets"),
        (dict(coefficient_type="custom", custom_coefficient_sets=[(1.0, 2.0)]), ValueError, r"custom_coefficient_sets\[0\]"),
        (dict(steps=-1), ValueError, "steps"),
        (dict(steps=4, coefficient_type="cubic5"), ValueError, "fixed 5-step schedule"),
        (dict(normalize_in_double=1), TypeError, "normalize_in_double"),
        (dict(precision="low"), ValueError, "precision"),
        (dict(eps=0.0), ValueError, "eps"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        me.newton_schulz(torch.randn(4, 5), **kwargs)


def test_bad_tensors():
    with pytest.raises(TypeError, match="float32"):
        me.newton_schulz(torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be 2d or 3d"):
        me.newton_schulz(torch.randn(5))
    with pytest.raises(TypeError, match="x must be 2d or 3d"):
        me.newton_schulz(torch.randn(2, 2, 4, 5))
    with pytest.raises(TypeError, match=r"xs\[1\] must be 2-D"):
        me.newton_schulz_list([torch.randn(4, 5), torch.randn(2, 4, 5)])


def test_signature_follows_emerging_optimizers():
    import inspect

    eo_utils = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.muon_utils")
    ours = inspect.signature(me.newton_schulz).parameters
    ref = inspect.signature(eo_utils.newton_schulz).parameters
    assert list(ours)[: len(ref)] == list(ref)
    # eps: 0.3.0 floors the norm at 1e-7, 0.4.0 (our default, see test_eo040_parity) at 1e-15
    for name in ("coefficient_type", "transpose", "tp_group", "use_syrk"):
        assert ours[name].default == ref[name].default, name


def test_positional_call_in_emerging_optimizers_order(gen):
    x = torch.randn(2, 12, 40, generator=gen)
    ours = me.newton_schulz(x, 3, "polar_express", None, 1e-7, False, None, True, precision="highest")
    # the same arguments by keyword (use_syrk=True: symmetric products, which the measured "auto" plan
    # of another process need not pick)
    assert torch.equal(ours, me.newton_schulz(x, steps=3, coefficient_type="polar_express", eps=1e-7, transpose=False,
                                              use_syrk=True, precision="highest"))
    with pytest.raises(TypeError, match="pass precision='highest' as a keyword"):
        me.newton_schulz(x, 5, "quintic", None, 1e-7, None, "highest")
    with pytest.raises(TypeError, match="use_syrk must be a bool"):
        me.newton_schulz(x, use_syrk="yes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("shape", [(96, 64), (64, 600), (2, 520, 520), (800, 777)])
def test_products_agree(device, precision, shape, gen):
    """products="symmetric" (the symmetric kernel or lower block panels) and "full" (one GEMM) each
    orthogonalize within the precision's tolerance of the float64 reference (the bounds of the
    parity tests above), in the standard and the Gram iteration. use_syrk=True is products="symmetric"."""
    x = _input(shape, gen, device)
    exact = newton_schulz_ref(x.cpu(), coefficient_type="quintic")
    if precision == "medium":
        recipe = newton_schulz_ref(x.cpu(), coefficient_type="quintic", dtype=torch.bfloat16)
        bound = max(TOLERANCE["medium"], bf16_input_tolerance(x, "quintic"), 1.25 * rel_err(recipe, exact))
    else:
        bound = ns_tolerance(x, precision, device)
    for algorithm in ("standard", "gram"):
        for products in ("auto", "symmetric", "full"):
            got = me.newton_schulz(x, precision=precision, algorithm=algorithm, products=products).cpu()
            assert rel_err(got, exact) <= bound, (products, algorithm)
    if x.ndim == 2:
        torch.testing.assert_close(me.newton_schulz(x, precision=precision, use_syrk=True),
                                   me.newton_schulz(x, precision=precision, products="symmetric"), rtol=0, atol=0)


def test_products_bad_values():
    x = torch.randn(8, 6)
    with pytest.raises(ValueError, match="products must be one of auto, symmetric, full"):
        me.newton_schulz(x, products="syrk")
    with pytest.raises(ValueError, match="use_syrk=True"):
        me.newton_schulz(x, use_syrk=True, products="full")
    with op_raises(ValueError, "products must be one of auto, symmetric, full"):
        torch.ops.megatron_eopt.newton_schulz(x, [1.0, 2.0, 3.0], 1, False, 1e-7, None, "highest", "auto", "clamp",
                                              1.0, False, False, "panels")


def test_op_checks_arguments_in_cpp():
    op = torch.ops.megatron_eopt.newton_schulz
    with op_raises(ValueError, "steps must be at least 1"):
        op(torch.randn(3, 4), [1.0, 2.0, 3.0], 0, False, 1e-7, None, "medium", "auto")
    with op_raises(ValueError, "coefficients"):
        op(torch.randn(3, 4), [1.0, 2.0], 1, False, 1e-7, None, "medium", "auto")
    with op_raises(ValueError, "precision"):
        op(torch.randn(3, 4), [1.0, 2.0, 3.0], 1, False, 1e-7, None, "bf16", "auto")
    with op_raises(TypeError, "float32"):
        op(torch.randn(3, 4).half(), [1.0, 2.0, 3.0], 1, False, 1e-7, None, "medium", "auto")


def test_cuda_kernels_reported():
    assert isinstance(me.cuda_kernels_built(), bool)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
def test_cuda_matches_cpu_highest(precision, gen):
    x = torch.randn(5, 128, 320, generator=gen)
    out = me.newton_schulz(x.cuda(), precision=precision).cpu()
    ref = me.newton_schulz(x, precision="highest")
    tol = TOLERANCE["medium"] if precision == "medium" else ns_tolerance(x, precision, "cuda")
    assert rel_err(out, ref) <= tol


@pytest.mark.gpu
def test_cuda_runs_on_the_current_stream(gen):
    # (The device guard with two GPUs: test_cuda_graphs_and_streams.py, skipped on one GPU.)
    x = torch.randn(2, 64, 96, generator=gen).cuda()
    out = on_a_side_stream(lambda: me.newton_schulz(x, precision="highest"))
    assert rel_err(out.cpu(), newton_schulz_ref(x.cpu())) <= TOLERANCE["highest"]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1024, 1024), (3, 200, 300), (3000, 4, 8)])
def test_cuda_is_run_to_run_identical(shape, gen):
    # The Frobenius norm sums per-block partials in a fixed order (no atomics), so repeated calls
    # are bit-identical, with many blocks per matrix as with one (the large batch).
    x = torch.randn(shape, generator=gen).cuda()
    first = me.newton_schulz(x, precision="highest")
    for _ in range(3):
        assert torch.equal(me.newton_schulz(x, precision="highest"), first)
    assert rel_err(first.cpu(), me.newton_schulz(x.cpu(), precision="highest")) <= TOLERANCE["highest"]


@pytest.mark.parametrize("precision", ["medium", "highest"])
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_cpu_results_do_not_depend_on_earlier_calls(precision, algorithm, gen):
    # The CPU iteration reuses its temporaries across calls (a per-thread pool): a call after
    # calls of other shapes and dtypes, and after one on non-finite input, gives the same bits.
    x = _input((3, 48, 80), gen, "cpu")
    first = me.newton_schulz(x, precision=precision, algorithm=algorithm)
    for other in ((2, 80, 48), (1, 300, 200), (5, 16, 16)):
        me.newton_schulz(_input(other, gen, "cpu"), precision=precision, algorithm=algorithm)
    me.newton_schulz(torch.full((3, 48, 80), float("nan")), precision=precision, algorithm=algorithm)
    again = me.newton_schulz(x, precision=precision, algorithm=algorithm)
    assert torch.equal(first, again)


def test_the_coefficients_module_and_the_function_both_import():
    import megatron_eopt.coefficients as ns
    import megatron_eopt.newton_schulz as fn  # the package attribute: the function

    assert isinstance(ns, types.ModuleType) and ns.get_coefficients is get_coefficients
    assert fn is me.newton_schulz and fn.__module__ == "megatron_eopt.ops._newton_schulz"
    # The module's old name is an alias of the same module object.
    assert importlib.import_module("megatron_eopt.newton_schulz") is ns is sys.modules["megatron_eopt.newton_schulz"]
    from megatron_eopt.newton_schulz import coefficient_table

    assert coefficient_table is ns.coefficient_table
    x = torch.randn(8, 5)
    torch.testing.assert_close(me.newton_schulz(x, precision="highest"), fn(x, precision="highest"))


def test_importing_the_old_module_name_first_leaves_the_function_in_place():
    code = ("from megatron_eopt.newton_schulz import get_coefficients\n"
            "import megatron_eopt as me, megatron_eopt.coefficients as ns, torch\n"
            "assert get_coefficients is ns.get_coefficients and me.coefficients is ns\n"
            "assert callable(me.newton_schulz) and not isinstance(me.newton_schulz, type(ns)), me.newton_schulz\n"
            "print(tuple(me.newton_schulz(torch.randn(6, 4), precision='highest').shape))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "(6, 4)"
