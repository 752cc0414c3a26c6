"""newton_schulz_split: parity with a per-part float64 reference (Megatron QKV layout with and
without output gate, row splits, per-head splits), scale modes, batching of equal parts,
Megatron-LM's TensorParallelMuon, bad input, opcheck and torch.compile."""

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.newton_schulz import COEFFICIENT_SETS
from reference import TOLERANCE, op_raises, rel_err
from second_moment_reference import split_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _qkv_sizes(heads, groups, kv_channels, gate=False):
    q = heads // groups * kv_channels
    return [q, q, kv_channels, kv_channels] if gate else [q, kv_channels, kv_channels]


# (split_sizes, num_groups, n): Megatron QKV with G query groups (GQA, MHA, MQA), with an output
# gate; fused gate/up halves; unequal row splits; per-head splits; parts tall and wide.
LAYOUTS = {
    "qkv_gqa": (_qkv_sizes(8, 4, 4), 4, 24),
    "qkv_mha": (_qkv_sizes(4, 4, 3), 4, 40),
    "qkv_mqa": (_qkv_sizes(6, 1, 5), 1, 16),
    "qkv_gate": (_qkv_sizes(8, 2, 4, gate=True), 2, 20),
    "gate_up": ([24, 24], 1, 16),
    "rows_unequal": ([10, 30, 7], 1, 12),
    "per_head": ([5] * 6, 1, 9),
    "single_part": ([37], 1, 97),
}


def _x(sizes, groups, n, gen, device):
    return torch.randn(groups * sum(sizes), n, generator=gen).to(device)


# Every layout with the default scale, every scale mode (and raw parts) on a gated QKV layout.
PARITY_CASES = [(layout, "spectral") for layout in LAYOUTS] + [
    ("qkv_gate", "shape_scaling"), ("qkv_gate", "unit_rms_norm"), ("qkv_gate", None), ("rows_unequal", None)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,scale_mode", PARITY_CASES)
def test_parity_fp32(device, layout, scale_mode, gen):
    sizes, groups, n = LAYOUTS[layout]
    x = _x(sizes, groups, n, gen, device)
    extra = 1.0 if scale_mode is None else 0.2
    out = me.newton_schulz_split(x, sizes, groups, precision="highest", scale_mode=scale_mode,
                                 extra_scale_factor=extra)
    assert out.shape == x.shape and out.dtype == torch.float32 and out.device == x.device
    ref = split_ref(x.cpu(), sizes, groups, scale_mode, extra)
    assert rel_err(out.cpu(), ref) <= TOLERANCE["highest"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["qkv_gqa", "qkv_gate", "per_head"])
def test_parity_bf16_and_schedule_arguments(device, layout, gen):
    sizes, groups, n = LAYOUTS[layout]
    x = _x(sizes, groups, n, gen, device)
    out = me.newton_schulz_split(x, sizes, groups, steps=7, coefficient_type="polar_express")
    ref = split_ref(x.cpu(), sizes, groups, dtype=torch.bfloat16, steps=7, coefficient_type="polar_express")
    assert rel_err(out.cpu(), ref) <= TOLERANCE["medium"]
    rows = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    out = me.newton_schulz_split(x, sizes, groups, steps=3, coefficient_type="custom", custom_coefficient_sets=rows,
                                 precision="highest", transpose=True, scale_mode=None)
    ref = split_ref(x.cpu(), sizes, groups, None, steps=3, coefficient_type="custom", custom=rows, transpose=True)
    assert rel_err(out.cpu(), ref) <= TOLERANCE["highest"]


def test_num_groups_inferred_like_megatron(gen):
    sizes, groups, n = LAYOUTS["qkv_gqa"]
    x = _x(sizes, groups, n, gen, "cpu")
    torch.testing.assert_close(me.newton_schulz_split(x, sizes, None, precision="highest"),
                               me.newton_schulz_split(x, sizes, groups, precision="highest"), rtol=0, atol=0)


def test_non_contiguous_input(gen):
    sizes, groups, n = LAYOUTS["qkv_gate"]
    base = torch.randn(n, groups * sum(sizes), generator=gen)
    out = me.newton_schulz_split(base.t(), sizes, groups, precision="highest")
    assert rel_err(out, split_ref(base.t(), sizes, groups)) <= TOLERANCE["highest"]


def _ns_calls(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "megatron_eopt::newton_schulz")


@pytest.mark.parametrize("layout,calls", [("qkv_gqa", 2), ("qkv_gate", 2), ("per_head", 1), ("gate_up", 1),
                                          ("rows_unequal", 3)])
def test_equal_parts_run_as_one_batch(layout, calls, gen):
    sizes, groups, n = LAYOUTS[layout]
    x = _x(sizes, groups, n, gen, "cpu")
    assert _ns_calls(lambda: me.newton_schulz_split(x, sizes, groups)) == calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["qkv_gqa", "qkv_gate", "per_head", "rows_unequal"])
def test_stack_of_projections_equals_per_matrix_calls_in_one_batch_per_size(device, layout, gen):
    # An optimizer stack (k, rows, n): every part of every matrix, one newton_schulz call per part
    # size, each matrix's result as if split on its own.
    sizes, groups, n = LAYOUTS[layout]
    stack = torch.stack([_x(sizes, groups, n, gen, device) for _ in range(3)])
    kw = dict(precision="highest", scale_mode="spectral")
    out = me.newton_schulz_split(stack, sizes, groups, **kw)
    assert out.shape == stack.shape
    for k in range(3):
        single = me.newton_schulz_split(stack[k], sizes, groups, **kw)
        if device == "cpu":
            torch.testing.assert_close(out[k], single, rtol=1e-5, atol=1e-6)
        else:
            # cuBLAS runs a batch of 3 with other kernels (summation orders) than a batch of 1:
            # the same math within fp32 rounding as amplified by 5 Newton-Schulz steps.
            assert rel_err(out[k], single) <= TOLERANCE["highest"]
    if device == "cpu":
        assert _ns_calls(lambda: me.newton_schulz_split(stack, sizes, groups)) == len(set(sizes))


def test_matches_megatron_tensor_parallel_muon(gen):
    emerging = pytest.importorskip("megatron.core.optimizer.emerging_optimizers")
    if not emerging.HAVE_EMERGING_OPTIMIZERS:
        pytest.skip("megatron-core without emerging_optimizers")
    sizes = _qkv_sizes(8, 2, 8, gate=True)
    p = torch.nn.Parameter(torch.zeros(2 * sum(sizes), 48))
    opt = emerging.TensorParallelMuon([p], split_qkv=True, is_qkv_fn=lambda _: True, qkv_split_shapes=sizes,
                                      num_ns_steps=5, coefficient_type="quintic", scale_mode="spectral",
                                      extra_scale_factor=0.5, tp_mode="blockwise")
    grad = torch.randn(p.shape, generator=gen)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        expected = opt.orthogonalize(p, grad)
    finally:
        torch.set_float32_matmul_precision(previous)
    out = me.newton_schulz_split(grad, sizes, None, precision="highest", extra_scale_factor=0.5)
    assert rel_err(out, expected) <= TOLERANCE["highest"]


# ------------------------------------------------------------------ bad input
BAD = [
    (dict(split_shapes=[4, 2, 2], num_groups=3), ValueError, "num_groups \\* sum\\(split_(shapes|sizes)\\)"),
    (dict(split_shapes=[4, 0, 4], num_groups=2), ValueError, "split_(shapes|sizes)\\[1\\] must be positive"),
    (dict(split_shapes=[], num_groups=2), ValueError, "split_(shapes|sizes) must not be empty"),
    (dict(split_shapes=[8], num_groups=0), ValueError, "num_groups must be positive"),
    (dict(split_shapes=[4, 4], num_groups=2, scale_mode="rms"), ValueError, "scale_mode"),
    (dict(split_shapes=[4, 4], num_groups=2, extra_scale_factor=float("nan")), ValueError, "extra_scale_factor"),
    (dict(split_shapes=[4, 4], num_groups=2, scale_mode=None, extra_scale_factor=0.2), ValueError,
     "extra_scale_factor"),
    (dict(split_shapes=[4, 4], num_groups=2, precision="low"), ValueError, "precision"),
    (dict(split_shapes=[4, 4], num_groups=2, steps=0), ValueError, "steps"),
    (dict(split_shapes=[4, 4], num_groups=2, algorithm="fast"), ValueError, "algorithm must be one of"),
]


def _direct(x, split_shapes, num_groups, scale_mode="spectral", extra_scale_factor=1.0, precision="medium", steps=5,
            algorithm="auto"):
    coeffs = [v for row in COEFFICIENT_SETS["quintic"] for v in row]
    return torch.ops.megatron_eopt.newton_schulz_split(x, split_shapes, num_groups, coeffs, steps, False, 1e-7, None,
                                                       precision, scale_mode, extra_scale_factor, algorithm)


@pytest.mark.parametrize("direct_op", [False, True], ids=["wrapper", "op"])
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_input(case, direct_op, gen):
    kwargs, exc, fragment = BAD[case]
    kwargs = dict(kwargs)
    x = torch.randn(16, 6, generator=gen)
    before = x.clone()
    with op_raises(exc, fragment) if direct_op else pytest.raises(exc, match=fragment):
        if direct_op:
            _direct(x, **kwargs)
        else:
            me.newton_schulz_split(x, kwargs.pop("split_shapes"), kwargs.pop("num_groups"), **kwargs)
    assert torch.equal(x, before)


@pytest.mark.parametrize("direct_op", [False, True], ids=["wrapper", "op"])
def test_bad_tensor(direct_op):
    cases = [(torch.randn(8, 4, dtype=torch.bfloat16), TypeError), (torch.randn(2, 2, 8, 4), ValueError)]
    for x, exc in cases:
        with op_raises(exc, "x must be") if direct_op else pytest.raises((TypeError, ValueError), match="x must be"):
            if direct_op:
                _direct(x, [4, 4], 1)
            else:
                me.newton_schulz_split(x, [4, 4], 1)


def test_split_sizes_is_the_deprecated_name_of_split_shapes(gen):
    x = torch.randn(12, 5, generator=gen)
    with pytest.warns(DeprecationWarning, match="split_shapes"):
        old = me.newton_schulz_split(x, split_sizes=[2, 1, 1], num_groups=3)
    assert torch.equal(old, me.newton_schulz_split(x, split_shapes=[2, 1, 1], num_groups=3))
    with pytest.raises(TypeError, match="both split_shapes and split_sizes"):
        me.newton_schulz_split(x, [2, 1, 1], 3, split_sizes=[2, 1, 1])


def test_inferred_num_groups_needs_divisible_rows(gen):
    with pytest.raises(ValueError, match="not a multiple of sum\\(split_shapes\\)"):
        me.newton_schulz_split(torch.randn(10, 4, generator=gen), [2, 1, 1], None)


# ------------------------------------------------------------------ opcheck and torch.compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout,scale_mode", [("qkv_gate", "spectral"), ("per_head", None),
                                               ("rows_unequal", "unit_rms_norm")])
def test_opcheck(device, layout, scale_mode, gen):
    sizes, groups, n = LAYOUTS[layout]
    x = _x(sizes, groups, n, gen, device)
    coeffs = [v for row in COEFFICIENT_SETS["quintic"] for v in row]
    torch.library.opcheck(torch.ops.megatron_eopt.newton_schulz_split.default,
                          (x, sizes, groups, coeffs, 5, False, 1e-7, None, "highest", scale_mode, 1.0, "auto"))
    torch.library.opcheck(torch.ops.megatron_eopt.newton_schulz_split.default,
                          (torch.stack([x, 2 * x]), sizes, groups, coeffs, 5, False, 1e-7, None, "highest", scale_mode,
                           1.0, "auto"))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_split_then_normuon(device, gen):
    sizes, groups, n = LAYOUTS["qkv_gqa"]

    def step(grad, v):
        o = me.newton_schulz_split(grad, sizes, groups, precision="highest", scale_mode=None)
        me.normuon_normalize_([o], [v])
        return o * me.get_muon_scale_factor(o.shape[0], o.shape[1])

    grad = _x(sizes, groups, n, gen, device)
    v_compiled = me.new_moment2_buffer("normuon", grad)
    v_eager = v_compiled.clone()
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(grad, v_compiled), step(grad, v_eager))
    torch.testing.assert_close(v_compiled, v_eager)
