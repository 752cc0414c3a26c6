"""Muon and AdaptiveMuon against Emerging-Optimizers 0.3.0 (the reference), over several steps."""

import functools

import pytest
import torch

from megatron_eopt.optim import AdaptiveMuon, Muon
from optim_helpers import SHAPES, ReferenceMuon, clone_params, make_grads, make_params
from optim_helpers import max_delta_err, max_delta_err_without_flips, max_state_err, run_steps
from reference import TOLERANCE, ns_tolerance

eo = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers")

STEPS = 3


def _fp32_tolerance(moment2_method):
    # AdaMuon divides elementwise by the root of its second moment: entries small in both O and v
    # come out at unit size carrying their own (large) relative rounding error, so the normwise
    # fp32 error of Newton–Schulz turns into an elementwise one. Emerging-Optimizers itself lands
    # up to 4e-4 away from the float64 result in these settings, as far as we do.
    return TOLERANCE["high"] if moment2_method == "adamuon" else TOLERANCE["highest"]


def _delta_err(moment2_method, flip_threshold=0.5, max_flip_fraction=0.005):
    # AdaMuon divides elementwise: an entry small in both O and v takes a large share of its own
    # rounding error (in bf16 even the sign of a near-zero entry of O, a whole step). Such
    # elements are counted (at most 0.5% of a param's in fp32) and the others compared normwise.
    # In fp32 an element counts once it differs by 1% of its own change, 1e3 times fp32
    # Newton-Schulz error. In bf16 the two implementations round independently (ours: B + a I
    # rounded once after an fp32 s x s product; theirs: fused bf16 baddbmm), each about 1% from
    # the exact result, and a Gaussian-like O has about 0.8% of its entries within 1% of its scale
    # of zero: expect ~1% flips; on a 16 x 16 param (256 elements) up to 8 were seen, so up to 5%
    # may flip, the rest must agree to bf16 accuracy.
    if moment2_method != "adamuon":
        return max_delta_err
    return functools.partial(max_delta_err_without_flips, flip_threshold=flip_threshold,
                             max_flip_fraction=max_flip_fraction)


def _compare(
    ours_cls,
    eo_cls,
    kwargs,
    gen,
    shapes=SHAPES,
    steps=STEPS,
    tol=TOLERANCE["highest"],
    state_keys=("momentum_buffer",),
    device="cpu",
    delta_err=max_delta_err,
):
    # Small weights: the fp32 rounding of p itself stays far below the compared change of p.
    params = make_params(shapes, gen, scale=0.1, device=device)
    start = [p.detach().clone() for p in params]
    ref_params = clone_params(params)
    grads = make_grads(params, gen, steps)
    ours = ours_cls(params, **kwargs)
    ref = eo_cls(ref_params, **kwargs)
    run_steps(ours, params, grads)
    run_steps(ref, ref_params, grads)
    assert delta_err(params, ref_params, start) <= tol
    assert max_state_err(ours, params, ref, ref_params, state_keys) <= tol


def _fp32(**kwargs):
    """The optimizer keywords, with Newton–Schulz in full fp32."""
    return dict(kwargs, fp32_matmul_prec="highest")


def _compare_adaptive(kwargs, gen, **compare_kwargs):
    """:func:`_compare` of AdaptiveMuon with EO's, momentum and second moment included."""
    _compare(
        AdaptiveMuon,
        eo.AdaptiveMuon,
        kwargs,
        gen,
        state_keys=("momentum_buffer", "moment2_buffer"),
        **compare_kwargs,
    )


@pytest.mark.parametrize("weight_decay_method", ["decoupled", "independent", "l2", "palm"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_weight_decay_and_nesterov(weight_decay_method, nesterov, gen):
    kwargs = _fp32(lr=0.03, momentum=0.9, weight_decay=0.2, nesterov=nesterov, weight_decay_method=weight_decay_method)
    _compare(Muon, eo.Muon, kwargs, gen)


@pytest.mark.parametrize(
    "coefficient_type,num_ns_steps",
    [
        ("simple", 5),
        ("quintic", 7),
        ("polar_express", 10),
        ("cans", 5),
        ("aol", 4),
        ("deepseekv4", 10),
    ],
)
def test_muon_coefficient_types(coefficient_type, num_ns_steps, gen):
    kwargs = dict(lr=0.02, coefficient_type=coefficient_type, num_ns_steps=num_ns_steps, fp32_matmul_prec="highest")
    # Rank-1 inputs under expanding schedules amplify fp32 rounding itself (see reference.py), so
    # those two compare on full-rank shapes only.
    shapes = [s for s in SHAPES if min(s) > 1] if coefficient_type in ("polar_express", "cans") else SHAPES
    # Even full-rank, cans magnifies fp32 rounding by up to ~5e3 (polar_express ~90): the two
    # implementations round their products differently (ours: BLAS product, then the fused scalar
    # step; theirs: baddbmm), so the tolerance follows the amplification of gradient-like inputs.
    tol = max(ns_tolerance(torch.randn(s, generator=gen), "highest", "cpu", coefficient_type, num_ns_steps)
              for s in shapes)
    _compare(Muon, eo.Muon, kwargs, gen, shapes=shapes, tol=tol)


@pytest.mark.parametrize(
    "scale_mode,extra", [("spectral", 1.0), ("shape_scaling", 1.0), ("unit_rms_norm", 0.2), ("spectral", 0.2)]
)
def test_muon_scale_modes(scale_mode, extra, gen):
    kwargs = dict(
        # lr 0.05: with unit_rms_norm x 0.2 a 1 x 9 row moves ~7e-4 per step at lr 0.01, close enough to
        # the fp32 rounding of its 0.1-sized weights to put 1e-5 of relative error into the change
        lr=0.05, weight_decay=0.0, scale_mode=scale_mode, extra_scale_factor=extra, fp32_matmul_prec="highest"
    )
    _compare(Muon, eo.Muon, kwargs, gen)


def test_muon_defaults_medium_precision(gen):
    # EO's defaults: lr 3e-4, momentum 0.95, weight decay 0.01 decoupled, "medium" (bf16 NS).
    _compare(Muon, eo.Muon, {}, gen, tol=TOLERANCE["medium"])


@pytest.mark.parametrize("moment2_method", ["adamuon", "normuon", "namo"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_adaptive_muon_moment2_methods(moment2_method, nesterov, gen):
    kwargs = _fp32(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=nesterov, moment2_method=moment2_method, beta2=0.9)
    _compare_adaptive(
        kwargs,
        gen,
        tol=_fp32_tolerance(moment2_method),
        delta_err=_delta_err(moment2_method, flip_threshold=0.01),
    )


CONFIGURATIONS = [  # (moment2_method, weight_decay_method, scale_mode): each method, mode and scale at least once
    ("adamuon", "l2", "shape_scaling"),
    ("normuon", "independent", "unit_rms_norm"),
    ("namo", "palm", "spectral"),
    ("normuon", "decoupled", "spectral"),
]


@pytest.mark.parametrize("moment2_method,weight_decay_method,scale_mode", CONFIGURATIONS)
def test_adaptive_muon_configurations(moment2_method, weight_decay_method, scale_mode, gen):
    # every hyper-parameter away from its default
    kwargs = dict(lr=0.01, momentum=0.95, weight_decay=0.3, moment2_method=moment2_method, scale_mode=scale_mode,
                  weight_decay_method=weight_decay_method, extra_scale_factor=0.2, eps=1e-6,
                  coefficient_type="polar_express", num_ns_steps=6, fp32_matmul_prec="highest")
    _compare_adaptive(
        kwargs,
        gen,
        shapes=[s for s in SHAPES if min(s) > 1],
        tol=_fp32_tolerance(moment2_method),
        delta_err=_delta_err(moment2_method, flip_threshold=0.01),
    )


@pytest.mark.parametrize("moment2_method", ["adamuon", "normuon", "namo"])
def test_adaptive_muon_medium_precision(moment2_method, gen):
    kwargs = dict(lr=0.01, momentum=0.95, weight_decay=0.01, moment2_method=moment2_method)
    _compare_adaptive(
        kwargs,
        gen,
        # Two bf16 Newton-Schulz implementations rounding at different points, each within docs/design.md §9's
        # bf16 tolerance of the exact result, are within twice it of each other; the second
        # moment's elementwise division passes that on to the update.
        tol=2 * TOLERANCE["medium"],
        delta_err=_delta_err(moment2_method, max_flip_fraction=0.05),
    )


def test_custom_coefficients_match_reference(gen):
    rows = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    params = make_params(SHAPES, gen)
    start = [p.detach().clone() for p in params]
    grads = make_grads(params, gen, STEPS)
    ours = Muon(
        params,
        lr=0.02,
        coefficient_type="custom",
        custom_coefficient_sets=rows,
        num_ns_steps=5,
        fp32_matmul_prec="highest",
    )
    ref = ReferenceMuon(params, 0.02, 0.95, 0.01, False, coefficient_type="custom", custom=rows)
    run_steps(ours, params, grads)
    for g in grads:
        ref.step(g)
    assert max_delta_err(params, ref.params, start) <= TOLERANCE["highest"]


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (Muon, dict(nesterov=True, weight_decay_method="independent")),
        (AdaptiveMuon, dict(lr=0.02, momentum=0.9, weight_decay=0.1, moment2_method="normuon")),
        (AdaptiveMuon, dict(lr=0.02, momentum=0.9, weight_decay=0.1, moment2_method="namo")),
    ],
)
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_bf16_fp16_and_mixed_dtype_params_match_float64_reference(cls, kwargs, low, gen):
    # Low-precision params keep state in their dtype; momentum math and NS run in fp32.
    kwargs = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.05, **kwargs, "fp32_matmul_prec": "highest"}
    params = make_params(SHAPES, gen, scale=0.01)
    for i in range(0, len(params), 2):
        params[i] = torch.nn.Parameter(params[i].detach().to(low))
    start = [p.detach().clone() for p in params]
    grads = make_grads(params, gen, STEPS)
    ours = cls(params, **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "fp32_matmul_prec"}
    ref_kwargs.setdefault("nesterov", False)
    ref = ReferenceMuon(params, **ref_kwargs)
    run_steps(ours, params, grads)
    for g in grads:
        ref.step(g)
    for p in params:
        assert ours.state[p]["momentum_buffer"].dtype == p.dtype
    bf16 = [i for i, p in enumerate(params) if p.dtype == low]
    fp32 = [i for i, p in enumerate(params) if p.dtype == torch.float32]
    pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
    assert max_delta_err(pick(params, bf16), pick(ref.params, bf16), pick(start, bf16)) <= TOLERANCE["medium"]
    assert max_delta_err(pick(params, fp32), pick(ref.params, fp32), pick(start, fp32)) <= TOLERANCE["highest"]


@pytest.mark.parametrize("ours,ref", [(Muon, eo.Muon), (AdaptiveMuon, eo.AdaptiveMuon)])
def test_constructor_signatures_match_emerging_optimizers(ours, ref):
    import inspect

    ours_sig = inspect.signature(ours.__init__).parameters
    ref_sig = inspect.signature(ref.__init__).parameters
    assert list(ours_sig)[: len(ref_sig)] == list(ref_sig)
    for name, param in ref_sig.items():
        assert (ours_sig[name].default, ours_sig[name].kind) == (param.default, param.kind), name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "precision,moment2_method",
    [("highest", m) for m in (None, "adamuon", "normuon", "namo")]
    # bf16 Newton–Schulz: AdaMuon's elementwise division would turn the bf16 rounding differences of
    # two GEMM libraries into elementwise ones (see _fp32_tolerance), so it is compared in fp32 only.
    + [("medium", m) for m in (None, "normuon", "namo")],
)
def test_cuda_parity_with_emerging_optimizers(precision, moment2_method, gen):
    kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True, fp32_matmul_prec=precision)
    shapes = SHAPES + [(256, 512), (512, 256)]
    tol = TOLERANCE["medium"] if precision == "medium" else _fp32_tolerance(moment2_method)
    if moment2_method is None:
        _compare(Muon, eo.Muon, kwargs, gen, shapes=shapes, tol=tol, device="cuda")
    else:
        kwargs.update(moment2_method=moment2_method)
        keys = ("momentum_buffer", "moment2_buffer")
        _compare(AdaptiveMuon, eo.AdaptiveMuon, kwargs, gen, shapes=shapes, tol=tol, device="cuda", state_keys=keys)


@pytest.mark.parametrize("cls_name", ["TensorParallelMuon", "Muon_ns_eps_1e-7"])
def test_tiny_gradients_keep_eo_030_numerics(cls_name, gen):
    # EO 0.3.0 floors the Newton–Schulz norm at 1e-7; Megatron-LM's classes (which pin 0.3.0), and
    # Muon with ns_eps=1e-7, do too: a gradient of norm ~1e-9 gets 0.3.0's shrunken update.
    from megatron_eopt.optim import TensorParallelMuon

    params = make_params([(24, 40), (40, 24)], gen)
    ref = clone_params(params)
    start = [p.detach().clone() for p in params]
    kwargs = dict(lr=1.0, momentum=0.0, weight_decay=0.0, nesterov=False, fp32_matmul_prec="highest")
    ours = TensorParallelMuon(params, **kwargs) if cls_name == "TensorParallelMuon" else Muon(params, ns_eps=1e-7, **kwargs)
    theirs = eo.muon.Muon(ref, **kwargs)
    grads = [[torch.randn(p.shape, generator=gen) * 1e-11 for p in params]]
    run_steps(ours, params, grads)
    run_steps(theirs, ref, grads)
    assert max_delta_err(params, ref, start) <= TOLERANCE["highest"]
    default = Muon(clone_params(start), **kwargs)  # 0.4.0's 1e-15: a larger update
    run_steps(default, default.param_groups[0]["params"], grads)
    full = sum(float((p.detach() - s).norm()) for p, s in zip(default.param_groups[0]["params"], start))
    shrunk = sum(float((p.detach() - s).norm()) for p, s in zip(params, start))
    assert shrunk < 0.8 * full


def test_fp32_matmul_prec_set_after_construction_as_emerging_optimizers_reads_it(gen):
    # EO stores the constructor's value as a plain attribute and reads it at every step: a user who
    # sets it later gets the new precision there, and here.
    params = make_params([(24, 40), (40, 24), (24, 40)], gen)
    ref = clone_params(params)
    start = [p.detach().clone() for p in params]
    kwargs = dict(lr=0.02, momentum=0.9, weight_decay=0.1, nesterov=True, fp32_matmul_prec="medium")
    ours, theirs = Muon(params, ns_eps=1e-7, **kwargs), eo.Muon(ref, **kwargs)
    ours.fp32_matmul_prec = theirs.fp32_matmul_prec = "highest"
    grads = make_grads(params, gen, 3)
    run_steps(ours, params, grads)
    run_steps(theirs, ref, grads)
    assert max_delta_err(params, ref, start) <= TOLERANCE["highest"]
