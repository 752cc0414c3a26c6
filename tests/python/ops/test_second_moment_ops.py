"""adamuon_normalize_, normuon_normalize_, namo_normalize_: parity with float64 references over
several steps (state carried), with Emerging-Optimizers' AdaptiveMuon, edge cases, bad input,
opcheck and torch.compile."""

import math

import pytest
import torch

import megatron_eopt as me
from reference import TOLERANCE, op_raises, rel_err
from second_moment_reference import adamuon_ref, namo_ref, normuon_ref

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
METHODS = ["adamuon", "normuon", "namo"]
SHAPES = [(1, 64), (64, 1), (97, 37), (37, 97), (48, 48), (1, 1), (3, 200)]
TOL = TOLERANCE["highest"]


def _randn(shape, gen, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def _run(method, updates, moment2, grads=None, ns_inputs=None, **kw):
    if method == "adamuon":
        me.adamuon_normalize_(updates, moment2, **kw)
    elif method == "normuon":
        me.normuon_normalize_(updates, moment2, **kw)
    else:
        me.namo_normalize_(updates, moment2, grads, ns_inputs, **kw)


def _ref(method, o, v, g=None, x=None, **kw):
    if method == "adamuon":
        return adamuon_ref(o, v, **kw)
    if method == "normuon":
        return normuon_ref(o, v, **kw)
    return namo_ref(o, v, g, x, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_parity_mixed_list_over_steps(device, method, gen):
    # NS outputs are O(1) per singular value; vary the scale per step so the EMA matters.
    states = [me.new_moment2_buffer(method, torch.empty(s, device=device)) for s in SHAPES]
    ref_states = [v.cpu().double() for v in states]
    for step, (beta2, scale) in enumerate([(0.95, 1.0), (0.95, 3.0), (0.95, 0.2), (0.5, 1.0)]):
        os_ = [_randn(s, gen, device, scale=scale / math.sqrt(max(s))) for s in SHAPES]
        gs = [_randn(s, gen, device, scale=scale) for s in SHAPES]
        xs = [_randn(s, gen, device) for s in SHAPES]
        ours = [o.clone() for o in os_]
        _run(method, ours, states, gs, xs, beta2=beta2, eps=1e-8)
        for i, shape in enumerate(SHAPES):
            out_ref, ref_states[i] = _ref(method, os_[i].cpu(), ref_states[i], gs[i].cpu(), xs[i].cpu(), beta2=beta2)
            assert ours[i].dtype == torch.float32 and ours[i].shape == shape
            assert rel_err(ours[i].cpu(), out_ref) <= TOL, (step, shape)
            assert rel_err(states[i].cpu(), ref_states[i]) <= TOL, (step, shape)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_long_list_spans_several_launches(device, method, gen):
    # 70 tensors: more than one launch's worth of descriptors (32) on CUDA.
    shapes = [(3 + i % 5, 2 + i % 7) for i in range(70)]
    os_ = [_randn(s, gen, device) for s in shapes]
    gs = [_randn(s, gen, device) for s in shapes]
    states = [me.new_moment2_buffer(method, o) + 0.25 for o in os_]
    expected = [_ref(method, o.cpu(), v.cpu(), g.cpu(), g.cpu()) for o, v, g in zip(os_, states, gs)]
    _run(method, os_, states, gs, gs)
    for o, v, (o_ref, v_ref) in zip(os_, states, expected):
        assert rel_err(o.cpu(), o_ref) <= TOL and rel_err(v.cpu(), v_ref) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_cuda_large_tensors_loop_over_capped_blocks(method, gen):
    # Row slices with more rows than 512 blocks x 16 warps, column slices with more than 512
    # tiles of 32 columns, and an elementwise pass over more than 1024 blocks x 2048 elements.
    shapes = [(20000, 48), (40, 20000), (2500, 1000)]
    os_ = [_randn(s, gen, "cuda", scale=0.05) for s in shapes]
    gs = [_randn(s, gen, "cuda") for s in shapes]
    states = [me.new_moment2_buffer(method, o) + 1e-3 for o in os_]
    expected = [_ref(method, o.cpu(), v.cpu(), g.cpu(), g.cpu()) for o, v, g in zip(os_, states, gs)]
    _run(method, os_, states, gs, gs)
    for o, v, (o_ref, v_ref) in zip(os_, states, expected):
        assert rel_err(o.cpu(), o_ref) <= TOL and rel_err(v.cpu(), v_ref) <= TOL


def _rel_err_consuming(out, ref):
    """||out - ref|| / ||ref||, overwriting ref (no extra full-size temporaries)."""
    ref_norm = float(ref.norm())
    return float(ref.sub_(out).norm()) / ref_norm


@pytest.mark.gpu
@pytest.mark.large_memory
@pytest.mark.parametrize("method", METHODS)
def test_cuda_more_than_2_31_elements(method):
    # 64-bit index math: 2^31 + 64 elements (8.6 GB per fp32 tensor, at most four alive), checked
    # against the same formulas in fp32 torch ops on the GPU (a float64 reference would not fit).
    rows, cols = 2**31 // 64 + 1, 64
    o = torch.randn(rows, cols, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    v = me.new_moment2_buffer(method, o)
    if method == "adamuon":
        v_ref = o.square().mul_(0.05)
        o_ref = v_ref.sqrt().add_(1e-8)
        torch.div(o, o_ref, out=o_ref)
        me.adamuon_normalize_([o], [v])
    elif method == "normuon":
        v_ref = o.square().mean(dim=1, keepdim=True).mul_(0.05)
        o_ref = o * v_ref.clamp_min(1e-8).rsqrt()
        o_ref.mul_(o.norm() / o_ref.norm())
        me.normuon_normalize_([o], [v])
    else:
        v_ref = 0.05 * o.norm() ** 2
        o_ref = o * (o.norm() / (v_ref.sqrt() + 1e-8))
        g = o.clone()
        me.namo_normalize_([o], [v], [g], [g])
        del g
    assert _rel_err_consuming(v, v_ref.reshape(v.shape)) <= 1e-5
    del v_ref
    assert _rel_err_consuming(o, o_ref) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16])
def test_namo_reduced_precision_inputs(device, input_dtype, gen):
    shapes = [(33, 17), (17, 33)]
    states = [torch.zeros(1, device=device), torch.zeros((), device=device)]  # (1,) and 0-D both accepted
    ref_states = [torch.zeros(1, dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
    for _ in range(2):
        os_ = [_randn(s, gen, device) for s in shapes]
        gs = [_randn(s, gen, device, input_dtype) for s in shapes]
        xs = [_randn(s, gen, device, input_dtype) for s in shapes]
        ours = [o.clone() for o in os_]
        me.namo_normalize_(ours, states, gs, xs)
        for i in range(2):
            out_ref, ref_states[i] = namo_ref(os_[i].cpu(), ref_states[i], gs[i].cpu(), xs[i].cpu())
            assert rel_err(ours[i].cpu(), out_ref) <= TOL
            assert rel_err(states[i].cpu(), ref_states[i]) <= TOL


@pytest.mark.parametrize("method", METHODS)
def test_matches_emerging_optimizers_adaptive_muon(method, gen):
    adaptive_muon = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.adaptive_muon")
    opt = adaptive_muon.AdaptiveMuon([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1, momentum=0.9,
                                     weight_decay=0.0, moment2_method=method)
    shapes = [(64, 1), (97, 37), (37, 97)]
    states = [me.new_moment2_buffer(method, torch.empty(s)) for s in shapes]
    ref_states = [v.clone() for v in states]
    for _ in range(3):
        os_ = [_randn(s, gen, "cpu") for s in shapes]
        gs = [_randn(s, gen, "cpu") for s in shapes]
        xs = [_randn(s, gen, "cpu") for s in shapes]
        ours = [o.clone() for o in os_]
        _run(method, ours, states, gs, xs, beta2=0.9, eps=1e-7)
        for i in range(len(shapes)):
            namo = method == "namo"
            expected = opt._apply_moment2_normalization(os_[i], ref_states[i], 0.9, 1e-7,
                                                        raw_grad=gs[i] if namo else None,
                                                        pre_orth_grad=xs[i] if namo else None)
            assert rel_err(ours[i], expected) <= 1e-6
            assert rel_err(states[i], ref_states[i]) <= 1e-6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_zero_inputs_give_zeros(device, method):
    shapes = [(5, 3), (3, 5), (4, 4)]
    updates = [torch.zeros(s, device=device) for s in shapes]
    states = [me.new_moment2_buffer(method, u) for u in updates]
    zeros = [torch.zeros(s, device=device) for s in shapes]
    for _ in range(2):
        _run(method, updates, states, zeros, zeros)
    for u, v in zip(updates, states):
        assert torch.equal(u, torch.zeros_like(u))
        assert torch.equal(v, torch.zeros_like(v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_non_contiguous_arguments_are_written_back(device, method, gen):
    base = _randn((37, 97), gen, device)
    o = base.t()  # (97, 37), non-contiguous
    v_shape = me.moment2_shape(method, 97, 37)
    v_store = torch.rand(tuple(reversed(v_shape)) if len(v_shape) == 2 else v_shape, generator=gen).to(device)
    v = v_store.t() if len(v_shape) == 2 else v_store
    g = _randn((37, 97), gen, device).t()
    x = _randn((37, 97), gen, device).t()
    out_ref, v_ref = _ref(method, o.cpu(), v.cpu(), g.cpu(), x.cpu())
    _run(method, [o], [v], [g], [x])
    assert rel_err(base.t().cpu(), out_ref) <= TOL
    assert rel_err(v_store.t().cpu() if len(v_shape) == 2 else v_store.cpu(), v_ref) <= TOL


def test_moment2_shapes_follow_the_reference():
    assert me.moment2_shape("adamuon", 97, 37) == (97, 37)
    assert me.moment2_shape("normuon", 97, 37) == (97, 1)
    assert me.moment2_shape("normuon", 37, 97) == (1, 97)
    assert me.moment2_shape("normuon", 48, 48) == (48, 1)
    assert me.moment2_shape("namo", 37, 97) == (1,)
    buf = me.new_moment2_buffer("normuon", torch.empty(3, 8, dtype=torch.bfloat16))
    assert buf.shape == (1, 8) and buf.dtype == torch.float32 and not buf.any()
    with pytest.raises(ValueError, match="moment2_method"):
        me.moment2_shape("adam", 2, 2)
    with pytest.raises(ValueError, match="param must be 2-D"):
        me.new_moment2_buffer("normuon", torch.zeros(4, 3, 2))


def test_empty_list_is_a_no_op():
    me.adamuon_normalize_([], [])
    me.normuon_normalize_([], [])
    me.namo_normalize_([], [], [], [])


# ------------------------------------------------------------------ bad input
def _bad_cases():
    """(method, mutate-args function, expected exception, message fragment); the bad entry is last."""
    def lists(method):
        shapes = [(6, 4), (4, 6)]
        updates = [torch.randn(s) for s in shapes]
        states = [me.new_moment2_buffer(method, u) + 0.5 for u in updates]
        grads = [torch.randn(s) for s in shapes]
        xs = [torch.randn(s) for s in shapes]
        return updates, states, grads, xs

    cases = []
    for method in METHODS:
        cases += [
            (method, lambda a: a[1].__setitem__(1, torch.zeros(3, 3)), ValueError, "moment2\\[1\\] has shape"),
            (method, lambda a: a[1].__setitem__(1, a[1][1].double()), TypeError, "moment2\\[1\\] must be float32"),
            (method, lambda a: a[0].__setitem__(1, a[0][1].bfloat16()), TypeError, "updates\\[1\\] must be float32"),
            (method, lambda a: a[0].__setitem__(1, a[0][1].unsqueeze(0)), (TypeError, ValueError),
             "updates\\[1\\] must be 2-D"),
            (method, lambda a: a[1].pop(), ValueError, "moment2 has 1 tensors"),
        ]
    cases += [
        ("namo", lambda a: a[2].__setitem__(1, torch.randn(6, 4)), ValueError, "grads\\[1\\] has shape"),
        ("namo", lambda a: a[3].__setitem__(1, torch.ones(4, 6, dtype=torch.int32)), TypeError,
         "ns_inputs\\[1\\] must be float32, bfloat16 or float16"),
        ("namo", lambda a: a[3].pop(), ValueError, "ns_inputs has 1 tensors"),
    ]
    return lists, cases


_LISTS, _CASES = _bad_cases()


def _call_op(method, args, beta2=0.95, eps=1e-8):
    updates, states, grads, xs = args
    beta2, eps = torch.tensor(beta2, dtype=torch.float64), torch.tensor(eps, dtype=torch.float64)
    if method == "namo":
        torch.ops.megatron_eopt.namo_normalize_(updates, states, grads, xs, beta2, eps)
    else:
        getattr(torch.ops.megatron_eopt, f"{method}_normalize_")(updates, states, beta2, eps)


@pytest.mark.parametrize("direct_op", [False, True], ids=["wrapper", "op"])
@pytest.mark.parametrize("case", range(len(_CASES)))
def test_bad_input_mutates_nothing(case, direct_op):
    method, mutate, exc, fragment = _CASES[case]
    args = _LISTS(method)
    mutate(args)
    before = [[t.clone() for t in lst] for lst in args]
    with op_raises(exc, fragment) if direct_op else pytest.raises(exc, match=fragment):
        if direct_op:
            _call_op(method, args)
        else:
            _run(method, *args)
    for lst, saved in zip(args, before):
        for t, s in zip(lst, saved):
            assert torch.equal(t, s)


@pytest.mark.parametrize("direct_op", [False, True], ids=["wrapper", "op"])
@pytest.mark.parametrize("beta2,eps,fragment", [(1.5, 1e-8, "beta2"), (float("nan"), 1e-8, "beta2"),
                                                (0.95, 0.0, "eps"), (0.95, float("inf"), "eps"),
                                                # finite doubles that are 0 / inf in the kernels' fp32
                                                (0.95, 1e-46, "eps must be finite and positive in float32"),
                                                (0.95, 1e39, "eps must be finite and positive in float32")])
@pytest.mark.parametrize("method", METHODS)
def test_bad_hyper_parameters(method, beta2, eps, fragment, direct_op):
    args = _LISTS(method)
    before = [[t.clone() for t in lst] for lst in args]
    with op_raises(ValueError, fragment) if direct_op else pytest.raises(ValueError, match=fragment):
        if direct_op:
            _call_op(method, args, beta2, eps)
        else:
            _run(method, *args, beta2=beta2, eps=eps)
    for lst, saved in zip(args, before):
        for t, s in zip(lst, saved):
            assert torch.equal(t, s)


# ------------------------------------------------------------------ opcheck and torch.compile
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("amp", [False, True])
def test_opcheck(device, method, amp, gen):
    beta2 = torch.tensor(0.9, device=device, dtype=torch.float64)
    eps = torch.tensor(1e-8, device=device)
    found_inf = torch.zeros((), device=device)
    shapes = [(9, 5), (5, 9), (9, 5)]
    updates = [_randn(s, gen, device) for s in shapes]
    states = [me.new_moment2_buffer(method, u) + 0.1 for u in updates]
    if method == "namo":
        grads = [_randn(s, gen, device, torch.bfloat16) for s in shapes]
        xs = [_randn(s, gen, device) for s in shapes]
        scalars = (beta2, eps, torch.tensor(2.0, device=device), found_inf) if amp else (beta2, eps)
        torch.library.opcheck(torch.ops.megatron_eopt.namo_normalize_.default, (updates, states, grads, xs, *scalars))
    else:
        op = getattr(torch.ops.megatron_eopt, f"{method}_normalize_").default
        torch.library.opcheck(op, (updates, states, beta2, eps, found_inf) if amp else (updates, states, beta2, eps))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_equals_eager(device, gen):
    def step(os_, v_ada, v_nor, v_namo, gs):
        a = [o.clone() for o in os_]
        b = [o.clone() for o in os_]
        c = [o.clone() for o in os_]
        me.adamuon_normalize_(a, v_ada, beta2=0.9)
        me.normuon_normalize_(b, v_nor)
        me.namo_normalize_(c, v_namo, gs, gs)
        return [x + y + z for x, y, z in zip(a, b, c)]

    shapes = [(12, 7), (7, 12)]
    os_ = [_randn(s, gen, device) for s in shapes]
    gs = [_randn(s, gen, device) for s in shapes]
    states = {m: [me.new_moment2_buffer(m, o) for o in os_] for m in METHODS}
    eager_states = {m: [v.clone() for v in vs] for m, vs in states.items()}
    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        out = compiled(os_, states["adamuon"], states["normuon"], states["namo"], gs)
        ref = step(os_, eager_states["adamuon"], eager_states["normuon"], eager_states["namo"], gs)
        for x, y in zip(out, ref):
            torch.testing.assert_close(x, y)
    for m in METHODS:
        for v, w in zip(states[m], eager_states[m]):
            torch.testing.assert_close(v, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_found_inf_leaves_updates_and_state_untouched(device, method, gen):
    # GradScaler's overflow flag is read on the device: a skipped step changes nothing.
    shapes = [(9, 5), (5, 9)]
    updates = [_randn(s, gen, device) for s in shapes]
    states = [me.new_moment2_buffer(method, u) + 0.25 for u in updates]
    grads = [_randn(s, gen, device) for s in shapes]
    before = [t.clone() for t in updates + states]
    _run(method, updates, states, grads, grads, found_inf=torch.ones((), device=device))
    assert all(torch.equal(a, b) for a, b in zip(before, updates + states))
    _run(method, updates, states, grads, grads, found_inf=torch.zeros((), device=device))
    assert not any(torch.equal(a, b) for a, b in zip(before, updates + states))


@pytest.mark.parametrize("device", DEVICES)
def test_namo_grad_scale_equals_unscaled_grads(device, gen):
    # A power-of-two scale divides exactly, so the scaled call must equal the unscaled one bitwise.
    shapes = [(9, 5), (1, 7)]
    updates = [_randn(s, gen, device) for s in shapes]
    grads = [_randn(s, gen, device) for s in shapes]
    xs = [_randn(s, gen, device) for s in shapes]
    states = [me.new_moment2_buffer("namo", u) + 0.25 for u in updates]
    ref_updates, ref_states = [u.clone() for u in updates], [v.clone() for v in states]
    me.namo_normalize_(ref_updates, ref_states, grads, xs)
    me.namo_normalize_(updates, states, [g * 65536 for g in grads], xs,
                       grad_scale=torch.tensor(65536.0, device=device))
    assert all(torch.equal(a, b) for a, b in zip(updates + states, ref_updates + ref_states))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_tensor_beta2_eps_change_without_recompiling(device, gen):
    from torch._dynamo.utils import counters

    def step(os_, vs, beta2, eps):
        me.adamuon_normalize_(os_, vs, beta2=beta2, eps=eps)

    shapes = [(12, 7), (7, 12)]
    states = [me.new_moment2_buffer("adamuon", torch.empty(s, device=device)) for s in shapes]
    eager_states = [v.clone() for v in states]
    beta2 = torch.tensor(0.9, device=device)
    eps = torch.tensor(1e-8, device=device)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    for t, (b, e) in enumerate([(0.9, 1e-8), (0.5, 1e-6), (0.99, 1e-3)]):
        beta2.fill_(b)
        eps.fill_(e)
        os_ = [_randn(s, gen, device) for s in shapes]
        ours, ref = [o.clone() for o in os_], [o.clone() for o in os_]
        compiled(ours, states, beta2, eps)
        # The eager call gets the fp32 tensors' values: with b itself, float(1 - 0.99) and
        # float(1 - fp32(0.99)) differ by 9.3e-7 relative, which carried into v exceeds rtol=1e-6
        # now and then (about 1 draw in 300, on either device).
        me.adamuon_normalize_(ref, eager_states, beta2=beta2.item(), eps=eps.item())
        for x, y in zip(ours + states, ref + eager_states):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=0)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.gpu
def test_normuon_cuda_follows_the_cpu_order(gen):
    # Both backends take the slice means from fp32-rounded squares and measure ||U'|| from the
    # rounded U' = fl(O * step) (Emerging-Optimizers 0.4's order); only the summation order of the
    # reductions differs (fp32 trees on CUDA, double on the CPU): a few ulp, over several steps.
    shapes = [(97, 37), (37, 97), (1, 64), (64, 1), (48, 48), (3, 700)]
    cpu_states = [me.new_moment2_buffer("normuon", torch.empty(s)) for s in shapes]
    gpu_states = [v.cuda() for v in cpu_states]
    for _ in range(4):
        os_ = [_randn(s, gen, "cpu", scale=0.05) for s in shapes]
        on_gpu = [o.cuda() for o in os_]
        me.normuon_normalize_(os_, cpu_states, beta2=0.95, eps=1e-8)
        me.normuon_normalize_(on_gpu, gpu_states, beta2=0.95, eps=1e-8)
        for a, b in zip(os_ + cpu_states, on_gpu + gpu_states):
            torch.testing.assert_close(b.cpu(), a, rtol=2**-19, atol=0)


@pytest.mark.gpu
def test_adamuon_cuda_equals_cpu_bitwise(gen):
    # The square is rounded before the EMA on both backends (no contraction into an FMA), so the
    # state carried over several steps stays bitwise equal.
    shapes = [(97, 37), (1, 64), (48, 48)]
    cpu_states = [me.new_moment2_buffer("adamuon", torch.empty(s)) for s in shapes]
    gpu_states = [v.cuda() for v in cpu_states]
    for _ in range(5):
        os_ = [_randn(s, gen, "cpu") for s in shapes]
        on_gpu = [o.cuda() for o in os_]
        me.adamuon_normalize_(os_, cpu_states, beta2=0.95, eps=1e-8)
        me.adamuon_normalize_(on_gpu, gpu_states, beta2=0.95, eps=1e-8)
        for a, b in zip(os_ + cpu_states, on_gpu + gpu_states):
            assert torch.equal(a, b.cpu())
