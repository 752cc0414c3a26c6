"""TensorParallelMuon / TensorParallelAdaptiveMuon on one process: QKV split and Megatron parity."""

import pytest

from megatron_eopt.optim import TensorParallelAdaptiveMuon, TensorParallelMuon
from optim_helpers import ReferenceMuon, clone_params, make_grads, make_params
from optim_helpers import max_delta_err, max_delta_err_without_flips, max_state_err, run_steps
from reference import TOLERANCE

HIGHEST = TOLERANCE["highest"]

# (shape, split shapes): 4 query groups of [q, k, v]; a wide one; 2 groups with an output gate.
QKV = [((4 * 12, 16), [8, 2, 2]), ((3 * 6, 40), [4, 1, 1]), ((2 * 20, 24), [6, 6, 4, 4])]
OTHERS = [(16, 16), (9, 1), (24, 40)]


def _params(gen):
    params = make_params([s for s, _ in QKV] + OTHERS, gen, scale=0.1)
    for p, (_, sizes) in zip(params, QKV):
        p.is_qkv = True
        p.qkv_split_shapes = sizes  # per-param shapes win over the constructor's
    return params


def _qkv_map(params):
    return {i: p.qkv_split_shapes for i, p in enumerate(params) if getattr(p, "is_qkv", False)}


@pytest.mark.parametrize("moment2_method", [None, "adamuon", "normuon", "namo"])
def test_qkv_split_matches_per_part_reference(moment2_method, gen):
    params = _params(gen)
    start = [p.detach().clone() for p in params]
    grads = make_grads(params, gen, 3)
    kwargs = dict(
        lr=0.02,
        momentum=0.9,
        weight_decay=0.1,
        split_qkv=True,
        is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
        qkv_split_shapes=[1, 1, 1],
        fp32_matmul_prec="highest",
        scale_mode="spectral",
        extra_scale_factor=0.5,
    )
    if moment2_method is None:
        ours = TensorParallelMuon(params, **kwargs)
    else:
        ours = TensorParallelAdaptiveMuon(params, moment2_method=moment2_method, beta2=0.9, **kwargs)
    ref = ReferenceMuon(
        params,
        0.02,
        0.9,
        0.1,
        True,
        extra_scale_factor=0.5,
        moment2_method=moment2_method,
        beta2=0.9,
        qkv=_qkv_map(params),
    )
    run_steps(ours, params, grads)
    for g in grads:
        ref.step(g)
    if moment2_method == "adamuon":
        # As test_optim_muon_parity: AdaMuon's elementwise division leaves an entry small in both O
        # and v with a large share of its own rounding error (seen: 1.3e-3 of the update normwise
        # on one seed in the fp32 SYRK kernel's summation order, under 1e-3 in ATen's GEMMs');
        # elements off by 1% of their change are counted (at most 0.5% of a param's, or one), the
        # rest compared normwise.
        err = max_delta_err_without_flips(params, ref.params, start, flip_threshold=0.01)
        assert err <= TOLERANCE["high"]
    else:
        assert max_delta_err(params, ref.params, start) <= HIGHEST


def _megatron():
    return pytest.importorskip("megatron.core.optimizer.emerging_optimizers")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(nesterov=False, use_decoupled_weight_decay=False, weight_decay=0.2),
        dict(split_qkv=True, scale_mode="shape_scaling", coefficient_type="polar_express", num_ns_steps=6),
        dict(split_qkv=True, tp_mode="blockwise", extra_scale_factor=0.2, coefficient_type="aol"),
    ],
)
def test_matches_megatron_tensor_parallel_muon_on_one_process(kwargs, gen):
    params = _params(gen)
    if kwargs.get("coefficient_type") == "polar_express":  # expanding schedule: full-rank shapes only
        params = [p for p in params if min(p.shape) > 1]
    ref_params = clone_params(params)
    for p, r in zip(params, ref_params):
        r.is_qkv = getattr(p, "is_qkv", False)
        if r.is_qkv:
            r.qkv_split_shapes = p.qkv_split_shapes
    start = [p.detach().clone() for p in params]
    grads = make_grads(params, gen, 3)
    kwargs = dict(lr=0.02, is_qkv_fn=lambda p: getattr(p, "is_qkv", False), fp32_matmul_prec="highest", **kwargs)
    ours = TensorParallelMuon(params, **kwargs)
    ref = _megatron().TensorParallelMuon(ref_params, **kwargs)
    run_steps(ours, params, grads)
    run_steps(ref, ref_params, grads)
    assert max_delta_err(params, ref_params, start) <= HIGHEST
    assert max_state_err(ours, params, ref, ref_params) <= HIGHEST


def test_constructor_signatures_match_megatron():
    import inspect

    megatron = _megatron()
    ours = inspect.signature(TensorParallelAdaptiveMuon.__init__).parameters
    ref = inspect.signature(megatron.TensorParallelAdaptiveMuon.__init__).parameters
    for name, param in ref.items():
        assert name in ours and ours[name].default == param.default, name
    ours = inspect.signature(TensorParallelMuon.__init__).parameters
    ref = inspect.signature(megatron.TensorParallelMuon.__init__).parameters
    assert list(ours)[: len(ref)] == list(ref)
    for name, param in ref.items():
        assert ours[name].default == param.default, name


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_use_syrk_selects_symmetric_products_with_the_same_results(precision):
    """Megatron-LM main's use_syrk: True runs the ops with symmetric products (products="symmetric"),
    False lets them choose; both equal full GEMMs (ns_products="full") within the precision's
    tolerance. The config field muon_use_syrk reaches the classes; a non-bool is a TypeError naming it."""
    import types

    import torch

    from megatron_eopt.registry import muon_config_to_kwargs
    from reference import TOLERANCE, rel_err

    gen = torch.Generator().manual_seed(0)
    shapes = [(96, 64), (64, 160), (130, 130)]
    start = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    finals = {}
    # NorMuon for the adaptive class: AdaMuon's first step is about sign(update), which turns the
    # products' last-place differences of near-zero entries into whole ones
    for cls, extra in ((TensorParallelMuon, {}), (TensorParallelAdaptiveMuon, dict(moment2_method="normuon"))):
        for products, options in (("auto", dict(use_syrk=False)), ("symmetric", dict(use_syrk=True)),
                                  ("full", dict(ns_products="full"))):
            params = [torch.nn.Parameter(t.clone()) for t in start]
            opt = cls(params, lr=0.02, fp32_matmul_prec=precision, **options, **extra)
            assert opt._config.products == products
            for step in grads:
                for p, g in zip(params, step):
                    p.grad = g.clone()
                opt.step()
            finals[cls, products] = [p.detach() for p in params]
        for products in ("auto", "symmetric"):
            for a, b, s in zip(finals[cls, products], finals[cls, "full"], start):
                assert rel_err(a - s, b - s) <= TOLERANCE[precision], (cls.__name__, products)
    with pytest.raises(TypeError, match="use_syrk must be a bool"):
        TensorParallelMuon([torch.nn.Parameter(torch.randn(8, 4))], use_syrk="yes")
    config = types.SimpleNamespace(lr=0.01, muon_use_syrk=True)
    assert muon_config_to_kwargs(config, [], None)["use_syrk"] is True
