"""Newton-Schulz on CUDA under the conditions a training loop creates: CUDA-graph capture and replay,
two streams at once, operands at any alignment, the cuBLAS fallback GEMM, production sizes against
float64, and more than one GPU in a process."""

import subprocess
import sys
import textwrap

import pytest
import torch

import megatron_eopt as me
from megatron_eopt._library import forced_blas_fallback, gemm_counts
from reference import TOLERANCE, bf16_input_tolerance, newton_schulz_ref, ns_tolerance, rel_err

pytestmark = pytest.mark.gpu

SWEEP = [(1, 37), (37, 1), (3, 97, 37), (1, 7, 300), "offset"]
PRECISIONS = ["medium", "high", "highest"]
ALGORITHMS = ["standard", "gram"]


def _input(shape, gen):
    """A CUDA input; "offset": a (97, 37) view 4 bytes past its storage's start (4-byte aligned)."""
    if shape == "offset":
        base = torch.randn(1 + 97 * 37, generator=gen).cuda()
        return base[1:].view(97, 37)
    return torch.randn(shape, generator=gen).cuda()


def _tolerance(x, precision):
    # x itself, not a copy: the tolerances of one input then share one SVD (ns_amplification keeps
    # the last), where three CPU SVDs of a 16 x 1024 x 4096 input took a minute
    if precision == "medium":
        return max(TOLERANCE["medium"], bf16_input_tolerance(x))
    return ns_tolerance(x, precision, "cuda")


def _captured(fn, static):
    """A CUDA graph of fn(static) after a warm-up on a side stream, and its output tensor."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    return graph, out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SWEEP, ids=str)
def test_sweep_is_right_repeatable_replayable_and_stream_safe(shape, precision, algorithm, gen):
    def ns(t):
        return me.newton_schulz(t, precision=precision, algorithm=algorithm)

    x = _input(shape, gen)
    first = ns(x)
    assert rel_err(first.cpu(), me.newton_schulz(x.cpu(), precision="highest", algorithm=algorithm)) <= _tolerance(
        x, precision)
    assert torch.equal(ns(x), first)  # bitwise repeatable

    # Replayed from a graph on fresh inputs: the bits of the eager call.
    static = _input(shape, gen)
    graph, out = _captured(ns, static)
    for _ in range(2):
        fresh = _input(shape, gen)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, ns(fresh))

    # Two streams at once, each with its own input: each result equals its eager call.
    inputs = [_input(shape, gen) for _ in range(2)]
    expected = [ns(t) for t in inputs]
    streams = [torch.cuda.Stream() for _ in inputs]
    results = [None, None]
    for _ in range(3):
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                results[i] = ns(inputs[i])
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        for r, e in zip(results, expected):
            assert torch.equal(r, e)


def test_capture_after_a_warm_up_on_differently_aligned_operands(gen):
    # The GEMM plans are chosen per problem and operand alignment; a plan chosen for a less aligned
    # view serves a more aligned capture (no "met for the first time while capturing" error).
    base = torch.randn(1 + 2 * 40 * 24, generator=gen).cuda()
    view = base[1:].view(2, 40, 24)
    for precision in PRECISIONS:
        me.newton_schulz(view, precision=precision, algorithm="standard")  # warm-up: 4-byte aligned operands
    for precision in PRECISIONS:
        static = torch.randn(2, 40, 24, generator=gen).cuda()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = me.newton_schulz(static, precision=precision, algorithm="standard")
        fresh = torch.randn(2, 40, 24, generator=gen).cuda()
        static.copy_(fresh)
        graph.replay()
        want = me.newton_schulz(fresh, precision=precision, algorithm="standard")
        assert rel_err(out, want) <= _tolerance(fresh, precision)


@pytest.mark.parametrize("shape", [(1, 37), (37, 1), (97, 37), (3, 24, 40), (2, 64, 256), (2, 16, 16384)], ids=str)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_forced_blas_fallback_matches_cublaslt(shape, precision, gen):
    # The cuBLAS GEMM (what serves problems cuBLASLt has no algorithm for) computes what cuBLASLt
    # does, in every precision, replays from a graph, and is the path that ran. (2, 16, 16384): a
    # 16 x 16 Gram over 16384 steps, the shape cuBLAS splits over K; in bf16 its partial sums must
    # stay fp32 (the math mode disallows reduced-precision reductions) to meet the bf16 tolerance.
    x = torch.randn(shape, generator=gen).cuda()
    for algorithm in ALGORITHMS:
        lt_out = me.newton_schulz(x, precision=precision, algorithm=algorithm)
        before = gemm_counts()
        with forced_blas_fallback():
            out = me.newton_schulz(x, precision=precision, algorithm=algorithm)
            torch.cuda.synchronize()
            after = gemm_counts()
            assert after[1] > before[1] and after[0] == before[0]
            graph, captured = _captured(lambda t: me.newton_schulz(t, precision=precision, algorithm=algorithm),
                                        x.clone())
            graph.replay()
            assert torch.equal(captured, me.newton_schulz(x, precision=precision, algorithm=algorithm))
        tol = _tolerance(x, precision)
        ref = me.newton_schulz(x.cpu(), precision="highest", algorithm=algorithm)
        assert rel_err(out.cpu(), ref) <= tol and rel_err(lt_out.cpu(), ref) <= tol


@pytest.mark.parametrize("shape,precisions", [((16, 1024, 4096), PRECISIONS), ((4, 4096, 14336), ["medium"])],
                         ids=["16x1024x4096", "4x4096x14336"])
def test_production_sizes_against_float64(shape, precisions, gen):
    # The default coefficient set and precision as users get them, on the GPU's float64 reference.
    # At 4096 x 14336 a "medium" split-K reduction with bf16 partial sums would show here.
    x = torch.randn(shape, generator=gen).cuda()
    ref = newton_schulz_ref(x)  # float64, on the GPU
    # Tolerances from the input's amplification where its SVD is cheap, else docs/design.md §9's figure.
    tolerance = _tolerance if shape[-2] * shape[-1] <= 2**22 else (lambda _x, p: TOLERANCE[p])
    for precision in precisions:
        tol = tolerance(x, precision)
        for algorithm in ("auto",) + tuple(ALGORITHMS):
            out = me.newton_schulz(x, precision=precision, algorithm=algorithm)
            assert rel_err(out, ref) <= tol, (precision, algorithm)


def test_first_call_inside_a_capture_says_to_warm_up():
    # A fresh process whose first Newton-Schulz call is captured: a clear error (the cuBLASLt
    # handle and the algorithm choice must happen before capture), not a CUDA failure.
    code = textwrap.dedent(
        """
        import torch, megatron_eopt as me
        x = torch.randn(64, 96, device="cuda")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                me.newton_schulz(x)
        except RuntimeError as e:  # ours, or the capture's end with ours as its context
            print("ERROR:", e, "| CONTEXT:", e.__context__)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "while a CUDA graph is being captured" in proc.stdout, proc.stdout + proc.stderr
    assert "warm-up" in proc.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_ops_run_on_their_tensors_device_whatever_the_current_device(gen):
    # Every op sets its tensors' device (a device guard) before it launches or allocates.
    x = torch.randn(3, 40, 24, generator=gen)
    ref = me.newton_schulz(x.cuda(0), precision="highest")
    with torch.cuda.device(0):
        on_1 = me.newton_schulz(x.cuda(1), precision="highest")
    assert on_1.device == torch.device("cuda", 1)
    torch.testing.assert_close(on_1.cpu(), ref.cpu(), rtol=0, atol=1e-6)
    params = [torch.nn.Parameter(torch.randn(24, 40, generator=gen).cuda(1))]
    params[0].grad = torch.randn(24, 40, generator=gen).cuda(1)
    twin = [torch.nn.Parameter(params[0].detach().cpu())]
    twin[0].grad = params[0].grad.cpu()
    with torch.cuda.device(0):
        me.optim.Muon(params, lr=0.02, fp32_matmul_prec="highest").step()
    me.optim.Muon(twin, lr=0.02, fp32_matmul_prec="highest").step()
    assert rel_err(params[0].detach().cpu(), twin[0].detach()) <= 1e-6
