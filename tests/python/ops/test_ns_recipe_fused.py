"""The 2026 recipe inside the Newton–Schulz ops (eps_mode, norm_divisor, row_equilibration,
frobenius_renorm of newton_schulz / newton_schulz_list / newton_schulz_split) against a float64
re-expression, on both algorithms and at "highest" and "medium"; defaults unchanged; opcheck;
the split (QKV) path with the options; CUDA against the CPU."""

import math

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.newton_schulz import get_coefficients
from megatron_eopt.optim._config import make_config
from reference import TOLERANCE, bf16_input_tolerance, ns_tolerance, op_raises, rel_err

SHAPES = [(1, 9), (9, 1), (97, 37), (37, 97), (3, 24, 40), (2, 40, 24), (1, 20, 50)]
OPTIONS = {
    "muoneq": dict(row_equilibration=True),
    "muon_plus": dict(frobenius_renorm=True),
    "add": dict(eps_mode="add"),
    "divisor": dict(norm_divisor=1.02),
    "add_divisor": dict(eps_mode="add", norm_divisor=1.01),
    "muoneq_add_divisor": dict(row_equilibration=True, eps_mode="add", norm_divisor=1.02),
    "muoneq_muon_plus": dict(row_equilibration=True, frobenius_renorm=True),
    "everything": dict(row_equilibration=True, frobenius_renorm=True, eps_mode="add", norm_divisor=1.01),
}
ALGORITHMS = ["standard", "gram"]
EPS = 1e-7
QUINTIC = get_coefficients("quintic", 5)


def prepare_ref(x, eps=EPS, eps_mode="clamp", norm_divisor=1.0, row_equilibration=False, **_):
    """float64: MuonEq and the normalization of each (m, n) matrix of a (..., m, n) tensor."""
    X = x.double()
    if row_equilibration:
        target = X.norm(dim=(-2, -1), keepdim=True) / math.sqrt(X.shape[-2])
        X = X * (target / X.norm(dim=-1, keepdim=True).clamp_min(1e-6))
    norm = X.norm(dim=(-2, -1), keepdim=True)
    denom = norm * norm_divisor + eps if eps_mode == "add" else norm.clamp_min(eps) * norm_divisor
    return X / denom


def iterate_ref(X, rows=QUINTIC, dtype=torch.float64):
    """The iteration on an already normalized (..., m, n) input, in `dtype` storage (bf16: fp32
    accumulation, as newton_schulz_ref's recipe), on the short side; float64 result."""
    tall = X.shape[-2] > X.shape[-1]
    X = (X.mT if tall else X).to(dtype)
    batched = X.ndim == 3
    if not batched:
        X = X.unsqueeze(0)
    for a, b, c in rows:
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    X = X if batched else X.squeeze(0)
    X = X.double()
    return X.mT if tall else X


def finish_ref(X, frobenius_renorm=False, **_):
    if frobenius_renorm:
        target = math.sqrt(min(X.shape[-2], X.shape[-1]))
        X = X * (target / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-6))
    return X


def recipe_ref(x, dtype=torch.float64, **opts):
    prepared = prepare_ref(x, **opts)
    if dtype != torch.float64:
        prepared = prepared.float()  # the op prepares in fp32, then rounds to the compute type
    return finish_ref(iterate_ref(prepared, dtype=dtype), **opts)


def check_against_ref(out, x, precision, opts):
    exact = recipe_ref(x, **opts)
    if precision == "highest":
        assert rel_err(out, exact) <= TOLERANCE["highest"]
        return
    # bf16 storage, as the existing Newton–Schulz tests bound it: docs/design.md §9's 2e-2, the input's bf16
    # amplification, or 1.25x the bf16 re-expression's own distance from float64.
    bf16 = recipe_ref(x, dtype=torch.bfloat16, **opts)
    bound = max(TOLERANCE["medium"], bf16_input_tolerance(prepare_ref(x, **opts).float()), 1.25 * rel_err(bf16, exact))
    assert rel_err(out, exact) <= bound


def ns(x, precision, algorithm, **opts):
    return me.newton_schulz(x, eps=EPS, precision=precision, algorithm=algorithm, **opts)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("precision", ["highest", "medium"])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("shape", SHAPES)
def test_option_matches_float64(shape, name, precision, algorithm, gen):
    opts = OPTIONS[name]
    x = torch.randn(shape, generator=gen) * 0.3
    if shape[-2] > 1:  # rows of very different norms, so MuonEq has something to equalize
        x = x * torch.logspace(-2, 1, shape[-2]).unsqueeze(-1)
    out = ns(x, precision, algorithm, **opts)
    assert out.shape == x.shape and out.dtype == torch.float32
    check_against_ref(out, x, precision, opts)
    if opts.get("frobenius_renorm"):
        target = math.sqrt(min(shape[-2:]))
        norms = out.double().norm(dim=(-2, -1))
        assert torch.allclose(norms, torch.full_like(norms, target), rtol=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_defaults_leave_results_unchanged(precision, algorithm, gen):
    x = torch.randn(3, 37, 23, generator=gen)
    op = torch.ops.megatron_eopt.newton_schulz
    coeffs = [v for row in QUINTIC for v in row]
    plain = op(x, coeffs, 5, False, EPS, None, precision, algorithm)
    explicit = op(x, coeffs, 5, False, EPS, None, precision, algorithm, "clamp", 1.0, False, False)
    assert torch.equal(plain, explicit)
    assert torch.equal(plain, ns(x, precision, algorithm, eps_mode="clamp", norm_divisor=1.0))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_eps_conventions_differ_only_for_tiny_norms(algorithm, gen):
    direction = torch.randn(20, 12, generator=gen)
    direction = direction / direction.norm()
    for scale, differ in ((1e-8, True), (1.0, False)):
        x = direction * scale
        outs = {}
        for mode in ("clamp", "add"):
            outs[mode] = ns(x, "highest", algorithm, eps_mode=mode)
            assert rel_err(outs[mode], recipe_ref(x, eps_mode=mode)) <= TOLERANCE["highest"], (mode, scale)
        assert (rel_err(outs["add"], outs["clamp"]) > 1e-2) == differ


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_norm_divisor_scales_the_input(algorithm, gen):
    # One step of (1, 0, 0) returns the normalized input: 1 / s of the plain one.
    x = torch.randn(2, 11, 17, generator=gen)
    kw = dict(steps=1, coefficient_type="custom", custom_coefficient_sets=[(1.0, 0.0, 0.0)], eps=EPS,
              precision="highest", algorithm=algorithm)
    plain = me.newton_schulz(x, **kw)
    divided = me.newton_schulz(x, norm_divisor=1.25, **kw)
    assert rel_err(divided * 1.25, plain) <= 1e-6


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_muoneq_equalizes_rows(algorithm, gen):
    # With the identity schedule the op returns its prepared input: every row at the RMS row norm.
    x = torch.randn(13, 29, generator=gen) * torch.logspace(-3, 2, 13).unsqueeze(-1)
    out = me.newton_schulz(x, steps=1, coefficient_type="custom", custom_coefficient_sets=[(1.0, 0.0, 0.0)],
                           eps=EPS, precision="highest", algorithm=algorithm, row_equilibration=True)
    rows = out.double().norm(dim=1)
    assert torch.allclose(rows, torch.full_like(rows, 1 / math.sqrt(13)), rtol=1e-5)
    assert rel_err(out, prepare_ref(x, row_equilibration=True)) <= 1e-6


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_zero_and_zero_rows_stay_finite(precision, algorithm, gen):
    opts = OPTIONS["everything"]
    zero = ns(torch.zeros(6, 10), precision, algorithm, **opts)
    assert torch.equal(zero, torch.zeros(6, 10))
    x = torch.randn(6, 10, generator=gen)
    x[2] = 0  # a zero row keeps a zero factor (0 / 1e-6) and stays zero
    out = ns(x, precision, algorithm, **opts)
    assert torch.isfinite(out).all() and torch.equal(out[2], torch.zeros(10))
    check_against_ref(out, x, precision, opts)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_strided_input(algorithm, gen):
    x = torch.randn(3, 40, 24, generator=gen).mT  # (3, 24, 40), not contiguous
    opts = OPTIONS["everything"]
    assert torch.equal(ns(x, "highest", algorithm, **opts), ns(x.contiguous(), "highest", algorithm, **opts))


def test_list_form_equals_per_matrix_calls(gen):
    xs = [torch.randn(s, generator=gen) for s in [(7, 5), (5, 7), (7, 5), (1, 4)]]
    opts = OPTIONS["everything"]
    outs = me.newton_schulz_list(xs, eps=EPS, precision="highest", **opts)
    for x, out in zip(xs, outs):
        assert rel_err(out, ns(x, "highest", "auto", **opts)) <= 1e-6
        assert rel_err(out, recipe_ref(x, **opts)) <= TOLERANCE["highest"]


def test_opcheck_with_the_recipe(gen):
    ops = torch.ops.megatron_eopt
    coeffs = [v for row in QUINTIC for v in row]
    recipe = ("add", 1.02, True, True)
    x = torch.randn(2, 12, 20, generator=gen)
    torch.library.opcheck(ops.newton_schulz.default, (x, coeffs, 5, False, EPS, None, "highest", "standard", *recipe))
    torch.library.opcheck(ops.newton_schulz.default, (x, coeffs, 5, False, EPS, None, "medium", "gram", *recipe))
    torch.library.opcheck(ops.newton_schulz_list.default,
                          ([x[0], x[1], torch.randn(9, 4, generator=gen)], coeffs, 5, False, EPS, None, "highest",
                           "auto", *recipe))
    qkv = torch.randn(2 * 12, 16, generator=gen)
    torch.library.opcheck(ops.newton_schulz_split.default,
                          (qkv, [6, 3, 3], 2, coeffs, 5, False, EPS, None, "highest", "spectral", 1.0, "auto", *recipe))


def test_compiled_call_with_the_recipe(gen):
    x = torch.randn(2, 12, 20, generator=gen)
    opts = OPTIONS["everything"]
    fn = torch.compile(lambda t: ns(t, "highest", "standard", **opts), fullgraph=True, backend="eager")
    assert torch.equal(fn(x), ns(x, "highest", "standard", **opts))


def test_bad_recipe_arguments():
    op = torch.ops.megatron_eopt.newton_schulz
    x = torch.randn(3, 4)
    with op_raises(ValueError, "eps_mode"):
        op(x, [1.0, 2.0, 3.0], 1, False, EPS, None, "highest", "auto", "sum", 1.0, False, False)
    with op_raises(ValueError, "norm_divisor"):
        op(x, [1.0, 2.0, 3.0], 1, False, EPS, None, "highest", "auto", "clamp", 0.5, False, False)
    with op_raises(ValueError, "norm_divisor"):
        torch.ops.megatron_eopt.newton_schulz_split(x, [1, 2], 1, [1.0, 2.0, 3.0], 1, False, EPS, None, "highest",
                                                    None, 1.0, "auto", "clamp", float("inf"), False, False)
    with pytest.raises(ValueError, match="eps_mode"):
        me.newton_schulz(x, eps_mode="sum")
    with pytest.raises(ValueError, match="norm_divisor"):
        me.newton_schulz_list([x], norm_divisor=float("nan"))
    with pytest.raises(ValueError, match="row_equilibration"):
        me.newton_schulz_split(x, [1, 2], row_equilibration=1)
    with pytest.raises(ValueError, match="do not apply"):
        me.newton_schulz(x, normalize_in_double=True, frobenius_renorm=True)
    with pytest.raises(ValueError, match="do not apply"):
        me.newton_schulz(x, steps=0, eps_mode="add")


# ---- split (QKV) ----

def split_ref(x, sizes, groups, scale_mode, **opts):
    """Each part the (groups * size, n) matrix of its rows across the groups, as its own matrix."""
    n = x.shape[-1]
    view = x.double().reshape(groups, sum(sizes), n)
    out = torch.empty_like(view)
    offset = 0
    for size in sizes:
        part = view[:, offset:offset + size].reshape(groups * size, n)
        o = recipe_ref(part, **opts)
        if scale_mode is not None:
            o = o * math.sqrt(max(groups * size, n))  # spectral
        out[:, offset:offset + size] = o.reshape(groups, size, n)
        offset += size
    return out.reshape(x.shape)


@pytest.mark.parametrize("name", ["muoneq", "muon_plus", "add_divisor", "everything"])
@pytest.mark.parametrize("sizes,groups", [([8, 4, 4], 3), ([8, 8, 4, 4], 2), ([5, 7], 1), ([6, 6, 6], 1)])
def test_split_with_the_recipe(name, sizes, groups, gen):
    opts = OPTIONS[name]
    x = torch.randn(groups * sum(sizes), 24, generator=gen) * torch.logspace(-1, 1, groups * sum(sizes)).unsqueeze(-1)
    out = me.newton_schulz_split(x, sizes, groups, eps=EPS, precision="highest", **opts)
    assert rel_err(out, split_ref(x, sizes, groups, "spectral", **opts)) <= TOLERANCE["highest"]
    raw = me.newton_schulz_split(x, sizes, groups, eps=EPS, precision="highest", scale_mode=None, **opts)
    assert rel_err(raw, split_ref(x, sizes, groups, None, **opts)) <= TOLERANCE["highest"]


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_config_split_accepts_the_recipe(precision, gen):
    # The optimizers' QKV path: OrthogonalizationConfig.newton_schulz_split with the options.
    opts = OPTIONS["everything"]
    cfg = make_config(nesterov=True, weight_decay_method="decoupled", fp32_matmul_prec=precision,
                      coefficient_type="quintic", custom_coefficient_sets=None, num_ns_steps=5, scale_mode="spectral",
                      extra_scale_factor=1.0, ns_eps=EPS, ns_eps_mode=opts["eps_mode"],
                      ns_norm_divisor=opts["norm_divisor"], row_equilibration=True, frobenius_renorm=True)
    x = torch.randn(2 * 16, 24, generator=gen)
    out = cfg.newton_schulz_split(x, [8, 4, 4], 2, scaled=True)
    ref = split_ref(x, [8, 4, 4], 2, "spectral", **opts)
    assert rel_err(out, ref) <= (TOLERANCE["highest"] if precision == "highest" else TOLERANCE["medium"])
    # the plain path of the same config runs the same recipe
    single = torch.randn(3, 20, 12, generator=gen)
    assert rel_err(cfg.newton_schulz(single), recipe_ref(single, **opts)) <= (
        TOLERANCE["highest"] if precision == "highest" else TOLERANCE["medium"])


# ---- CUDA ----

@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_cuda_matches_cpu(name, precision, algorithm, gen):
    # Against float64 at each precision's bound (as the existing CUDA tests: ns_tolerance for fp32 /
    # TF32, the bf16 bounds for "medium"), and in fp32 against the CPU op.
    opts = OPTIONS[name]
    for shape in [(1, 64), (64, 1), (97, 37), (37, 97), (3, 128, 320), (2, 320, 128)]:
        x = torch.randn(shape, generator=gen) * torch.logspace(-1, 1, shape[-2]).unsqueeze(-1)
        out = ns(x.cuda(), precision, algorithm, **opts).cpu()
        exact = recipe_ref(x, **opts)
        prepared = prepare_ref(x, **opts).float()
        if precision == "medium":
            bf16 = recipe_ref(x, dtype=torch.bfloat16, **opts)
            bound = max(TOLERANCE["medium"], bf16_input_tolerance(prepared), 1.5 * rel_err(bf16, exact))
        else:
            bound = ns_tolerance(prepared, precision, "cuda")
        assert rel_err(out, exact) <= bound, shape
        if precision == "highest":
            assert rel_err(out, ns(x, "highest", algorithm, **opts)) <= 2 * TOLERANCE["highest"], shape


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_cuda_defaults_unchanged_and_deterministic(algorithm, gen):
    x = torch.randn(5, 96, 200, generator=gen).cuda()
    op = torch.ops.megatron_eopt.newton_schulz
    coeffs = [v for row in QUINTIC for v in row]
    for precision in ("highest", "medium"):
        plain = op(x, coeffs, 5, False, EPS, None, precision, algorithm)
        assert torch.equal(plain, op(x, coeffs, 5, False, EPS, None, precision, algorithm, "clamp", 1.0, False, False))
    opts = OPTIONS["everything"]
    first = ns(x, "medium", algorithm, **opts)
    for _ in range(3):
        assert torch.equal(ns(x, "medium", algorithm, **opts), first)


@pytest.mark.gpu
def test_cuda_large_batch_slices(gen):
    # More matrices than grid.y allows (65535): the reductions and passes run in slices.
    x = torch.randn(70000, 4, 6, generator=gen)
    opts = OPTIONS["everything"]
    out = ns(x.cuda(), "highest", "standard", **opts).cpu()
    idx = torch.tensor([0, 1, 65534, 65535, 65536, 69999])
    assert rel_err(out[idx], recipe_ref(x[idx], **opts)) <= 1e-4
    norms = out.double().norm(dim=(-2, -1))
    assert torch.allclose(norms, torch.full_like(norms, 2.0), rtol=1e-5)


@pytest.mark.gpu
def test_cuda_graph_capture_with_the_recipe(gen):
    opts = OPTIONS["everything"]
    static = torch.randn(3, 64, 96, generator=gen).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ns(static, "medium", "auto", **opts)  # warm-up (cuBLASLt handles, allocator pools)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = ns(static, "medium", "auto", **opts)
    fresh = torch.randn(3, 64, 96, generator=gen).cuda()
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(result, ns(fresh, "medium", "auto", **opts))


@pytest.mark.gpu
def test_cuda_split_with_the_recipe(gen):
    opts = OPTIONS["everything"]
    x = torch.randn(3 * 16, 40, generator=gen)
    out = me.newton_schulz_split(x.cuda(), [8, 4, 4], 3, eps=EPS, precision="highest", **opts).cpu()
    assert rel_err(out, split_ref(x, [8, 4, 4], 3, "spectral", **opts)) <= 1e-4
