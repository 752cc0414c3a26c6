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
    assert list(ours)[: len(ref)] == list(ref)  # the installed megatron-core's positional order
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


_POSITIONAL_VALUES = dict(
    lr=0.03, momentum=0.8, nesterov=False, weight_decay=0.2, use_decoupled_weight_decay=False, split_qkv=False,
    is_qkv_fn=None, qkv_split_shapes=[4, 2, 2], fp32_matmul_prec="highest", coefficient_type="aol", num_ns_steps=4,
    scale_mode="shape_scaling", extra_scale_factor=0.5, pg_collection=None, tp_mode="blockwise", use_syrk=True,
    moment2_method="normuon", beta2=0.9, eps=1e-6,
)


def _check_positional_construction(cls, names):
    """Builds ``cls`` with ``_POSITIONAL_VALUES`` passed positionally in the order ``names`` and checks
    each landed in its argument."""
    import torch

    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = cls([p], *[_POSITIONAL_VALUES[n] for n in names])
    group = opt.param_groups[0]
    got = dict(lr=group["lr"], momentum=group["momentum"], weight_decay=group["weight_decay"],
               nesterov=opt.nesterov, use_decoupled_weight_decay=opt.weight_decay_method == "decoupled",
               qkv_split_shapes=opt.qkv_split_shapes, fp32_matmul_prec=opt.fp32_matmul_prec,
               coefficient_type=opt._config.coefficient_type, num_ns_steps=opt._config.num_ns_steps,
               scale_mode=opt.scale_mode, extra_scale_factor=opt.extra_scale_factor, tp_mode=opt.tp_mode,
               use_syrk=opt._config.products == "symmetric", moment2_method=getattr(opt, "moment2_method", None),
               beta2=group.get("beta2"), eps=group.get("eps"), split_qkv=opt.split_qkv, pg_collection=opt.pg_collection,
               is_qkv_fn=opt.is_qkv_fn)
    for name in names:
        assert got[name] == _POSITIONAL_VALUES[name], name


def test_adaptive_positional_order_is_the_installed_megatron_cores():
    """TensorParallelAdaptiveMuon takes its positional arguments in the order of the installed
    megatron-core's class (0.19.2: moment2_method right after tp_mode; main: use_syrk first)."""
    import inspect

    megatron = _megatron()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ref = [n for n, p in inspect.signature(megatron.TensorParallelAdaptiveMuon).parameters.items()
           if p.kind in kinds and n != "params"]
    assert TensorParallelAdaptiveMuon.POSITIONAL_TAIL == tuple(ref[ref.index("tp_mode") + 1:])
    _check_positional_construction(TensorParallelAdaptiveMuon, ref)
    ref_muon = [n for n, p in inspect.signature(megatron.TensorParallelMuon).parameters.items()
                if p.kind in kinds and n != "params"]
    _check_positional_construction(TensorParallelMuon, ref_muon)


def test_adaptive_positional_order_of_main(monkeypatch):
    """With Megatron-LM main's order in force, use_syrk is the positional argument after tp_mode; an
    argument given twice, or one too many, is the TypeError a def gives."""
    import inspect

    from megatron_eopt.optim import tensor_parallel as tp

    main = tp.adaptive_signature(tp.ADAPTIVE_TAIL_MAIN)
    monkeypatch.setattr(tp, "_ADAPTIVE_SIGNATURE", main)
    names = [n for n, p in main.parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD][2:]
    assert names[names.index("tp_mode") + 1:] == ["use_syrk", "moment2_method", "beta2", "eps"]
    _check_positional_construction(TensorParallelAdaptiveMuon, names)
    import torch

    p = [torch.nn.Parameter(torch.randn(6, 4))]
    with pytest.raises(TypeError, match="multiple values for argument 'lr'"):
        TensorParallelAdaptiveMuon(p, 0.1, lr=0.2)
    with pytest.raises(TypeError, match="too many positional"):
        TensorParallelAdaptiveMuon(p, *[_POSITIONAL_VALUES[n] for n in names], 1)
    with pytest.raises(TypeError, match="no_such"):
        TensorParallelAdaptiveMuon(p, no_such=1)
    # 0.19's order: use_syrk keyword-only
    old = tp.adaptive_signature(("moment2_method", "beta2", "eps"))
    assert old.parameters["use_syrk"].kind is inspect.Parameter.KEYWORD_ONLY
    assert list(old.parameters)[list(old.parameters).index("tp_mode") + 1] == "moment2_method"
    assert tp.adaptive_signature(("moment2_method", "new_arg")) == main  # unknown names: main's


def test_adaptive_order_read_from_megatron_source_without_importing(tmp_path, monkeypatch):
    """Without megatron-core's module loaded, the order comes from the source of the megatron-core
    that ``import megatron.core`` would load (first on sys.path), parsed, not imported."""
    import sys

    from megatron_eopt.optim import tensor_parallel as tp

    folder = tmp_path / "megatron" / "core" / "optimizer"
    folder.mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (folder / "emerging_optimizers.py").write_text(
        "class TensorParallelAdaptiveMuon(Base):\n"
        "    def __init__(self, params, lr=1.0, tp_mode='duplicated', use_syrk=False, moment2_method='adamuon',\n"
        "                 beta2=0.95, eps=1e-8):\n"
        "        pass\n"
    )
    monkeypatch.delitem(sys.modules, "megatron.core.optimizer.emerging_optimizers", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert tp.installed_adaptive_tail() == ("use_syrk", "moment2_method", "beta2", "eps")
    (folder / "emerging_optimizers.py").write_text("x = 1\n")
    assert tp.installed_adaptive_tail() is None


def test_newton_schulz_floor_follows_megatron():
    """Megatron-LM's classes normalize with Emerging-Optimizers' default eps: 1e-7 in the release
    Megatron-LM pins (0.2.0 / 0.3.0), 1e-15 with use_syrk=True (main needs EO >= 0.4 for it); ns_eps
    chooses it. A gradient of norm 1e-12 shows it: the 1e-7 floor shrinks it, 1e-15 orthogonalizes it."""
    import torch

    from megatron_eopt.newton_schulz import NS_EPS, NS_EPS_EO_030

    for cls in (TensorParallelMuon, TensorParallelAdaptiveMuon):
        p = [torch.nn.Parameter(torch.zeros(8, 8))]
        assert cls(p)._config.ns_eps == NS_EPS_EO_030 == 1e-7
        assert cls(p, use_syrk=True)._config.ns_eps == NS_EPS == 1e-15
        assert cls(p, use_syrk=True, ns_eps=1e-7)._config.ns_eps == 1e-7
        assert cls(p, ns_eps=1e-10)._config.recipe.eps == 1e-10
        with pytest.raises(ValueError, match="ns_eps"):
            cls(p, ns_eps=0.0)
    steps = {}
    for options in (dict(), dict(ns_eps=1e-15)):
        p = torch.nn.Parameter(torch.zeros(8, 8))
        opt = TensorParallelMuon([p], lr=1.0, momentum=0.0, weight_decay=0.0, fp32_matmul_prec="highest", **options)
        p.grad = torch.eye(8) * 1e-12 / 8 ** 0.5  # Frobenius norm 1e-12
        opt.step()
        steps[options.get("ns_eps", 1e-7)] = -p.detach()
    assert steps[1e-7].abs().max() < 1e-2 * steps[1e-15].abs().max()
