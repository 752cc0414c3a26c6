"""Products with a symmetric result on CUDA as block panels plus a mirror (by default where an H100
measured them faster; any shape with ``set_cuda_symmetric_products``): the same results as the
full products within rounding, in every precision, both algorithms, batched, on awkward shapes,
from CUDA graphs and through the cuBLAS fallback. The panel plan and the default rule are tested on
the host by GoogleTest (tests/cpp/test_symmetric_panels.cpp)."""

import contextlib

import pytest
import torch

import megatron_eopt as me
from megatron_eopt._library import forced_blas_fallback, gemm_counts
from reference import TOLERANCE, newton_schulz_ref, ns_tolerance, rel_err

OFF = (1, 1024)


@contextlib.contextmanager
def panels(max_blocks: int | None, min_panel: int = 1024):
    before = me.cuda_symmetric_products()
    me.set_cuda_symmetric_products(max_blocks, min_panel)
    try:
        yield
    finally:
        me.set_cuda_symmetric_products(*(before or (None,)))


@pytest.mark.parametrize("name, value", [("max_blocks", 0), ("max_blocks", 2.0), ("max_blocks", True),
                                         ("min_panel", 32), ("min_panel", "64"), ("min_panel", None)])
def test_bad_rule_names_the_argument_and_changes_nothing(name, value):
    before = me.cuda_symmetric_products()
    kwargs = {"max_blocks": 4, "min_panel": 256, name: value}
    with pytest.raises(ValueError, match=name):
        me.set_cuda_symmetric_products(**kwargs)
    assert me.cuda_symmetric_products() == before


@pytest.mark.skipif(not me.cuda_kernels_built(), reason="needs the CUDA kernels (not a GPU)")
def test_rule_is_the_measured_default_until_set_and_round_trips():
    assert me.cuda_symmetric_products() is None
    with panels(8, 512):
        assert me.cuda_symmetric_products() == (8, 512)
        with panels(*OFF):
            assert me.cuda_symmetric_products() == OFF
        assert me.cuda_symmetric_products() == (8, 512)
    assert me.cuda_symmetric_products() is None


SHAPES = [(1, 256, 640), (2, 640, 256), (3, 193, 193), (2, 300, 1000), (1, 64, 500), (1, 1, 300), (4, 130, 130)]


def _tolerance(x, precision):
    return TOLERANCE["medium"] if precision == "medium" else ns_tolerance(x, precision, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("precision", ["medium", "high", "highest"])
@pytest.mark.parametrize("shape", SHAPES)
def test_panels_match_float64_and_the_full_products(shape, precision, algorithm, gen):
    x = torch.randn(shape, generator=gen).cuda()
    with panels(*OFF):
        full = me.newton_schulz(x, precision=precision, algorithm=algorithm)
    with panels(4, 64):
        got = me.newton_schulz(x, precision=precision, algorithm=algorithm)
    ref = newton_schulz_ref(x.cpu().double())
    # Near-singular squares amplify rounding in bf16 beyond the plain tolerance (docs/limits.md):
    # the panels must then be no worse than the full products' own error.
    full_err = rel_err(full.cpu(), ref)
    tol = max(_tolerance(x.cpu(), precision), 1.5 * full_err)
    assert rel_err(got.cpu(), ref) <= tol
    # Against the full products: the same arithmetic, other GEMM kernels per panel.
    assert rel_err(got, full) <= 2 * tol


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ["standard", "gram"])
def test_panels_run_one_gemm_per_block_column(algorithm, gen):
    x = torch.randn(2, 512, 1536, generator=gen).cuda()
    kwargs = dict(steps=5, precision="highest", algorithm=algorithm)
    me.newton_schulz(x, **kwargs)
    torch.cuda.synchronize()
    before = sum(gemm_counts())
    me.newton_schulz(x, **kwargs)  # the default: full products at this size
    full_calls = sum(gemm_counts()) - before
    with panels(4, 128):  # side 512: 4 blocks of 128
        before = sum(gemm_counts())
        me.newton_schulz(x, **kwargs)
        panel_calls = sum(gemm_counts()) - before
    if algorithm == "standard":  # per step: W W^T and G G symmetric, B W general
        assert (full_calls, panel_calls) == (5 * 3, 5 * (4 + 4 + 1))
    else:
        assert panel_calls > full_calls


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["medium", "highest"])
def test_panels_in_a_cuda_graph_and_through_the_blas_fallback(precision, gen):
    x = torch.randn(3, 256, 384, generator=gen).cuda()
    with panels(4, 64):
        eager = me.newton_schulz(x, precision=precision)  # warm-up: the panels' plans
        static = x.clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = me.newton_schulz(static, precision=precision)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        # The fallback copies C into D per matrix: panels of a batch keep each other's blocks.
        with forced_blas_fallback():
            fallback = me.newton_schulz(x, precision=precision)
    assert rel_err(fallback, eager) <= _tolerance(x.cpu(), precision)


@pytest.mark.gpu
def test_panels_are_run_to_run_identical(gen):
    x = torch.randn(2, 700, 900, generator=gen).cuda()
    with panels(4, 128):
        first = me.newton_schulz(x, precision="medium")
        for _ in range(3):
            assert torch.equal(me.newton_schulz(x, precision="medium"), first)


@pytest.mark.gpu
def test_default_uses_panels_for_a_batch_of_four_4096_squares_in_bf16(gen):
    x = torch.randn(4, 4096, 4096, generator=gen).cuda()
    before = sum(gemm_counts())
    auto = me.newton_schulz(x, steps=2, precision="medium")
    assert sum(gemm_counts()) - before == 2 * (4 + 4 + 1)
    with panels(*OFF):
        full = me.newton_schulz(x, steps=2, precision="medium")
    assert rel_err(auto, full) <= TOLERANCE["medium"]
