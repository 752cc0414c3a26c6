"""foreach_momentum_ and foreach_update_: parity, op contract, torch.compile, bad input."""


import pytest
import torch

import megatron_eopt as me
from reference import op_raises, rel_err

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
METHODS = ["decoupled", "independent", "l2", "palm"]
# Awkward shapes, empty tensors and a tensor spanning three 64K-element chunks, in one list.
SHAPES = [(1, 64), (64, 1), (97, 37), (0, 5), (37, 97), (7,), (3, 5, 4), (0,), (150_001,)]
# (grads/params, momentum buffers, NS inputs)
MOMENTUM_DTYPES = [
    (torch.float32, torch.float32, torch.float32),
    (torch.float32, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float16, torch.float16, torch.float32),
    (torch.float16, torch.float32, torch.bfloat16),
]
# (params, updates)
UPDATE_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                 (torch.float16, torch.float32), (torch.float16, torch.float16)]
ops = torch.ops.megatron_eopt


def _randn(shape, gen, dtype, device):
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def _tolerance(*dtypes):
    if torch.bfloat16 in dtypes:
        return 2e-2
    return 2e-3 if torch.float16 in dtypes else 1e-5


def _one_ulp(dtype):
    return torch.finfo(dtype).eps  # relative spacing: a 1-ulp difference stays within it


def _momentum_inputs(gen, device, dtypes, shapes=SHAPES):
    grad_dtype, buf_dtype, ns_dtype = dtypes
    grads = [_randn(s, gen, grad_dtype, device) for s in shapes]
    bufs = [_randn(s, gen, buf_dtype, device) for s in shapes]
    params = [_randn(s, gen, grad_dtype, device) for s in shapes]
    ns = [torch.full(s, float("nan"), dtype=ns_dtype, device=device) for s in shapes]
    return grads, bufs, ns, params


def _momentum_ref64(grads, bufs, params, momentum, nesterov, wd, method):
    """docs/design.md §4.6 steps 1-3 in float64."""
    out_bufs, out_ns = [], []
    for g, m, p in zip(grads, bufs, params):
        g = g.double()
        if method == "l2":
            g = g + wd * p.double()
        m = m.double() + (1 - momentum) * (g - m.double())
        out_bufs.append(m)
        out_ns.append(g + momentum * (m - g) if nesterov else m)
    return out_bufs, out_ns


def _f32(t):
    """An fp32 copy (never `t` itself), to run an in-place reference op on."""
    return t.to(torch.float32, copy=True)


def _momentum_mirror(grads, bufs, params, momentum, nesterov, wd, method, ns_dtype):
    """The reference optimizer's own torch ops (Emerging-Optimizers' step), each evaluated in fp32
    and stored in its tensor's dtype, as torch's CUDA kernels do for bf16. (torch's CPU add rounds
    `alpha` to bf16 for bf16 tensors; the fused ops keep it in fp32 on both backends.)"""
    out_bufs, out_ns = [], []
    for g, m, p in zip(grads, bufs, params):
        if method == "l2" and wd != 0.0:
            g = _f32(g).add_(p.float(), alpha=wd).to(g.dtype)
        ema_dtype = torch.promote_types(g.dtype, m.dtype)
        m = _f32(m).lerp_(g.float(), 1 - momentum).to(m.dtype)
        ns = g.float().lerp(m.float(), momentum).to(ema_dtype) if nesterov else m
        out_bufs.append(m)
        out_ns.append(ns.to(ns_dtype))
    return out_bufs, out_ns


def _update_mirror(p0, u, scale, lr, f):
    """p.add_(p, alpha=-f); p.add_(U * scale, alpha=-lr), each in fp32 and stored in p's dtype."""
    p = p0
    if f != 0.0:
        p = _f32(p).add_(p.float(), alpha=-f).to(p0.dtype)
    return _f32(p).add_(u.float() * scale, alpha=-lr).to(p0.dtype)


def _update_and_check_inputs(params, updates, scales, lr, wd, method):
    """foreach_update_ on the lists; checks the updates are left as they were and the params keep
    their dtype; returns the params from before."""
    before = [p.clone() for p in params]
    updates_before = [u.clone() for u in updates]
    me.foreach_update_(params, updates, scales, lr=lr, weight_decay=wd, weight_decay_method=method)
    for i, p in enumerate(params):
        assert torch.equal(updates[i], updates_before[i]) and p.dtype == before[i].dtype, i
    return before


def _decay_factor(method, lr, wd):
    return {"decoupled": wd * lr, "independent": wd, "palm": wd * lr * lr, "l2": 0.0}[method]


# ------------------------------------------------------------------ momentum parity
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", MOMENTUM_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_momentum_parity(device, dtypes, nesterov, method, gen):
    momentum, wd = 0.95, 0.1
    grads, bufs, ns, params = _momentum_inputs(gen, device, dtypes)
    grads_before, params_before, bufs_before = [g.clone() for g in grads], [p.clone() for p in params], [
        m.clone() for m in bufs]
    ref_bufs, ref_ns = _momentum_ref64(grads, bufs, params, momentum, nesterov, wd, method)
    mirror_bufs, mirror_ns = _momentum_mirror(grads, bufs, params, momentum, nesterov, wd, method, dtypes[2])
    me.foreach_momentum_(grads, bufs, ns, params if method == "l2" else [], momentum=momentum, nesterov=nesterov,
                         weight_decay=wd, weight_decay_method=method)
    for i in range(len(SHAPES)):
        assert torch.equal(grads[i], grads_before[i]) and torch.equal(params[i], params_before[i])
        assert bufs[i].dtype == dtypes[1] and ns[i].dtype == dtypes[2]
        if grads[i].numel() == 0:
            continue
        assert rel_err(bufs[i].cpu(), ref_bufs[i].cpu()) <= _tolerance(dtypes[0], dtypes[1])
        assert rel_err(ns[i].cpu(), ref_ns[i].cpu()) <= _tolerance(*dtypes)
        # Within one unit in the last place of the reference's own ops (in practice: equal).
        torch.testing.assert_close(bufs[i], mirror_bufs[i], rtol=_one_ulp(dtypes[1]), atol=1e-30)
        torch.testing.assert_close(ns[i], mirror_ns[i], rtol=_one_ulp(dtypes[2]), atol=1e-30)
        assert not torch.equal(bufs[i], bufs_before[i])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("momentum", [0.0, 0.3, 0.5, 0.9, 0.99])
def test_momentum_matches_torch_lerp_on_both_sides_of_half(device, momentum, gen):
    # torch.lerp switches formula at weight 0.5: 1 - momentum and momentum land on either side.
    grads, bufs, ns, _ = _momentum_inputs(gen, device, MOMENTUM_DTYPES[0], shapes=[(513, 129)])
    expected_buf = bufs[0].lerp(grads[0], 1 - momentum)
    expected_ns = grads[0].lerp(expected_buf, momentum)
    me.foreach_momentum_(grads, bufs, ns, momentum=momentum, nesterov=True)
    torch.testing.assert_close(bufs[0], expected_buf, rtol=_one_ulp(torch.float32), atol=1e-30)
    torch.testing.assert_close(ns[0], expected_ns, rtol=_one_ulp(torch.float32), atol=1e-30)


def test_momentum_ns_inputs_as_slices_of_a_stacked_batch(gen):
    # The optimizer writes NS inputs straight into a (k, m, n) batch; odd m*n misaligns slices >= 1.
    grads, bufs, _, _ = _momentum_inputs(gen, "cpu", MOMENTUM_DTYPES[0], shapes=[(5, 7)] * 3)
    stacked = torch.zeros(3, 5, 7, dtype=torch.bfloat16)
    ref_bufs, ref_ns = _momentum_mirror(grads, bufs, grads, 0.9, True, 0.0, "decoupled", torch.bfloat16)
    me.foreach_momentum_(grads, bufs, list(stacked.unbind(0)), momentum=0.9, nesterov=True)
    torch.testing.assert_close(stacked, torch.stack(ref_ns), rtol=_one_ulp(torch.bfloat16), atol=1e-30)


def test_dense_non_contiguous_layouts_are_supported(gen):
    # Transposed (dense, non-overlapping) tensors: fine as long as an index's tensors share strides.
    grads, bufs, ns, params = _momentum_inputs(gen, "cpu", MOMENTUM_DTYPES[0], shapes=[(6, 9), (1, 5)])
    grads, bufs, ns, params = ([t.t() for t in ts] for ts in (grads, bufs, ns, params))
    assert not bufs[0].is_contiguous()
    ref_bufs, ref_ns = _momentum_mirror(grads, bufs, params, 0.9, True, 0.2, "l2", torch.float32)
    me.foreach_momentum_(grads, bufs, ns, params, momentum=0.9, nesterov=True, weight_decay=0.2,
                         weight_decay_method="l2")
    updates = [torch.randn(t.shape, generator=gen).t().contiguous().t() for t in ns]
    expected = [_update_mirror(p, u, 1.5, 0.1, 0.1 * 0.2) for p, u in zip(params, updates)]
    me.foreach_update_(params, updates, [1.5, 1.5], lr=0.1, weight_decay=0.2)
    for i in range(2):
        torch.testing.assert_close(bufs[i], ref_bufs[i], rtol=_one_ulp(torch.float32), atol=1e-30)
        torch.testing.assert_close(ns[i], ref_ns[i], rtol=_one_ulp(torch.float32), atol=1e-30)
        torch.testing.assert_close(params[i], expected[i], rtol=1e-6, atol=1e-7)


def test_momentum_l2_zero_decay_and_params_given_for_other_methods(gen):
    grads, bufs, ns, params = _momentum_inputs(gen, "cpu", MOMENTUM_DTYPES[0], shapes=[(9, 4), (4,)])
    ref_bufs, ref_ns = _momentum_ref64(grads, bufs, params, 0.8, False, 0.0, "l2")
    me.foreach_momentum_(grads, bufs, ns, params, momentum=0.8, nesterov=False, weight_decay=0.0,
                         weight_decay_method="l2")
    grads2, bufs2, ns2, params2 = _momentum_inputs(gen, "cpu", MOMENTUM_DTYPES[0], shapes=[(9, 4), (4,)])
    ref_bufs2, _ = _momentum_ref64(grads2, bufs2, params2, 0.8, False, 0.5, "palm")
    me.foreach_momentum_(grads2, bufs2, ns2, params2, momentum=0.8, nesterov=False, weight_decay=0.5,
                         weight_decay_method="palm")  # params given but not read: palm decays in the update
    for i in range(2):
        assert rel_err(bufs[i], ref_bufs[i]) <= 1e-6 and torch.equal(ns[i], bufs[i])
        assert rel_err(bufs2[i], ref_bufs2[i]) <= 1e-6


# ------------------------------------------------------------------ update parity
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", UPDATE_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("method", METHODS)
def test_update_parity(device, dtypes, method, gen):
    # fp32 values, as an optimizer's 0-dim fp32 lr / weight-decay tensors hold them
    lr, wd = float(torch.tensor(0.05)), float(torch.tensor(0.3))
    param_dtype, update_dtype = dtypes
    params = [_randn(s, gen, param_dtype, device) for s in SHAPES]
    updates = [_randn(s, gen, update_dtype, device) for s in SHAPES]
    scales = [0.5 + i for i in range(len(SHAPES))]
    before = _update_and_check_inputs(params, updates, scales, lr, wd, method)
    f = _decay_factor(method, lr, wd)
    for i, (p0, u, s) in enumerate(zip(before, updates, scales)):
        if p0.numel() == 0:
            continue
        # The reference's ops: p.add_(p, alpha=-f); p.add_(U * scale, alpha=-lr).
        mirror = _update_mirror(p0, u, s, lr, f)
        torch.testing.assert_close(params[i], mirror, rtol=_one_ulp(param_dtype), atol=1e-30)
        if param_dtype == torch.float32:
            # The step itself (not just p, which dominates) against float64.
            step64 = -f * p0.double() - lr * s * u.double()
            assert rel_err((params[i] - p0).cpu(), step64.cpu()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_update_with_tensor_hyperparameters(device, gen):
    params = [_randn((33, 65), gen, torch.float32, device)]
    updates = [_randn((33, 65), gen, torch.float32, device)]
    expected = params[0] * (1 - 0.02 * 0.1) - 0.02 * 3.0 * updates[0]
    lr = torch.tensor(0.02, device=device)
    wd = torch.tensor(0.1, device=device)
    me.foreach_update_(params, updates, [3.0], lr=lr, weight_decay=wd)
    assert rel_err(params[0].cpu(), expected.cpu()) <= 1e-6


# ------------------------------------------------------------------ cautious weight decay
CAUTIOUS_SHAPES = [(1, 64), (64, 1), (97, 37), (0, 5), (37, 97), (7,), (150_001,)]


def _cautious_mirror(p0, u, scale, lr, wd):
    """Cautious decay as separate torch ops, p.sub_(p * (U·p >= 0) * f.to(p.dtype)) with f = lr·wd,
    the mask read in fp32 before the decay, then p.add_(U * scale, alpha=-lr) in fp32."""
    p = p0.clone()
    keep = (u.float() * p.float()) >= 0
    p.sub_(p * keep * torch.tensor(lr * wd, dtype=torch.float64).to(p.dtype))
    return _f32(p).add_(u.float() * scale, alpha=-lr).to(p0.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", UPDATE_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d))
def test_update_cautious_parity(device, dtypes, gen):
    lr, wd = float(torch.tensor(0.05)), float(torch.tensor(0.3))
    param_dtype, update_dtype = dtypes
    params = [_randn(s, gen, param_dtype, device) for s in CAUTIOUS_SHAPES]
    updates = [_randn(s, gen, update_dtype, device) for s in CAUTIOUS_SHAPES]
    for p, u in zip(params, updates):  # both signs of U·p in every tensor of two or more values
        if p.numel() >= 2:
            flat_p, flat_u = p.view(-1), u.view(-1)
            flat_u[0] = flat_u[0].abs() * torch.where(flat_p[0] >= 0, 1.0, -1.0).to(u.dtype)
            flat_u[1] = -flat_u[1].abs() * torch.where(flat_p[1] >= 0, 1.0, -1.0).to(u.dtype)
    scales = [0.5 + i for i in range(len(CAUTIOUS_SHAPES))]
    before = _update_and_check_inputs(params, updates, scales, lr, wd, "cautious")
    for i, (p0, u, s) in enumerate(zip(before, updates, scales)):
        if p0.numel() == 0:
            continue
        mirror = _cautious_mirror(p0, u, s, lr, wd)
        torch.testing.assert_close(params[i], mirror, rtol=_one_ulp(param_dtype), atol=1e-30)
        # float64: decay exactly where the update and the weight agree in sign
        p64, u64 = p0.double(), u.double()
        mask = (u64 * p64) >= 0
        assert 0 < int(mask.sum()) < p0.numel() or p0.numel() == 1
        step64 = -lr * wd * p64 * mask - lr * s * u64
        if param_dtype == torch.float32:
            assert rel_err((params[i] - p0).cpu(), step64.cpu()) <= 1e-5
        else:
            assert rel_err(params[i].double().cpu(), (p64 + step64).cpu()) <= _tolerance(param_dtype)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_update_cautious_equals_a_separate_masked_decay_bitwise(param_dtype, gen):
    # What optimizers ran before the decay moved into the op: the masked decay in torch, then the
    # fused update without decay. The fused op gives the same bits.
    shapes = [(1, 33), (33, 1), (97, 37), (128, 256)]
    lr = torch.tensor(0.02, dtype=torch.float64)
    wd = torch.tensor(0.2, dtype=torch.float64)
    params = [_randn(s, gen, param_dtype, "cpu") for s in shapes]
    updates = [_randn(s, gen, torch.float32, "cpu") for s in shapes]
    scales = [1.5, 0.25, 3.0, 1.0]
    separate = [p.clone() for p in params]
    coef = lr * wd
    for p, u in zip(separate, updates):
        keep = (u * p) >= 0
        p.sub_(p * keep * coef.to(p.dtype))
    me.foreach_update_(separate, updates, scales, lr=lr, weight_decay=torch.zeros((), dtype=torch.float64))
    me.foreach_update_(params, updates, scales, lr=lr, weight_decay=wd, weight_decay_method="cautious")
    for a, b in zip(params, separate):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_update_cautious_scale_zero_applies_the_masked_decay_alone(device, gen):
    p = _randn((9, 13), gen, torch.float32, device)
    u = _randn((9, 13), gen, torch.float32, device)
    out = p.clone()
    me.foreach_update_([out], [u], [0.0], lr=0.1, weight_decay=0.5, weight_decay_method="cautious")
    keep = (u * p) >= 0
    assert torch.equal(out[~keep], p[~keep])
    torch.testing.assert_close(out[keep], p[keep] - p[keep] * torch.tensor(0.1 * 0.5).float(), rtol=1e-7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_cautious_is_decoupled(device, nesterov, gen):
    # cautious decays the parameter in foreach_update_; the momentum op leaves the gradient alone
    grads, bufs, ns, params = _momentum_inputs(gen, device, MOMENTUM_DTYPES[2])
    bufs2, ns2 = [b.clone() for b in bufs], [n.clone() for n in ns]
    me.foreach_momentum_(grads, bufs, ns, params, momentum=0.9, nesterov=nesterov, weight_decay=0.5,
                         weight_decay_method="cautious")
    me.foreach_momentum_(grads, bufs2, ns2, momentum=0.9, nesterov=nesterov, weight_decay=0.5,
                         weight_decay_method="decoupled")
    for a, b in zip(bufs + ns, bufs2 + ns2):
        assert torch.equal(a, b) or (a.numel() == 0 and b.numel() == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_skips_cautious_update(device, gen):
    params = [_randn(s, gen, torch.bfloat16, device) for s in CAUTIOUS_SHAPES]
    updates = [_randn(s, gen, torch.float32, device) for s in CAUTIOUS_SHAPES]
    before = [p.clone() for p in params]
    found = torch.ones((), device=device)
    me.foreach_update_(params, updates, [1.0] * len(params), lr=0.1, weight_decay=0.3,
                       weight_decay_method="cautious", found_inf=found)
    for a, b in zip(before, params):
        assert torch.equal(a, b)
    found.zero_()
    me.foreach_update_(params, updates, [1.0] * len(params), lr=0.1, weight_decay=0.3,
                       weight_decay_method="cautious", found_inf=found)
    assert not torch.equal(params[2], before[2])


# ------------------------------------------------------------------ GradScaler: unscale and skip
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [MOMENTUM_DTYPES[0], MOMENTUM_DTYPES[2], MOMENTUM_DTYPES[6]],
                         ids=lambda d: "-".join(str(t)[6:] for t in d))
def test_momentum_grad_scale_unscales_in_fp32(device, dtypes, gen):
    # The scaled gradient is divided in fp32 inside the op (never stored unscaled), as torch's
    # fused optimizers do: equal to the fp32 reference over grad / scale.
    scale = 3000.0  # not a power of two: the division rounds
    grads, bufs, ns, params = _momentum_inputs(gen, device, dtypes)
    scaled = [(g.float() * scale).to(g.dtype) for g in grads]
    # Elementwise division by a same-shape tensor: IEEE division on every device (torch's CUDA
    # division by a Python number multiplies by its reciprocal, one rounding more).
    unscaled = [g.float() / torch.full_like(g, scale, dtype=torch.float32) for g in scaled]
    ref_bufs, ref_ns = _momentum_mirror(unscaled, bufs, params, 0.9, True, 0.0, "decoupled",
                                        dtypes[2])
    me.foreach_momentum_(scaled, bufs, ns, momentum=0.9, nesterov=True,
                         grad_scale=torch.tensor(scale, device=device), found_inf=torch.zeros((), device=device))
    for i in range(len(SHAPES)):
        torch.testing.assert_close(bufs[i], ref_bufs[i].to(dtypes[1]), rtol=_one_ulp(dtypes[1]), atol=1e-30)
        # The Nesterov output is stored in the EMA's dtype (the gradients' and buffers' promotion).
        want_ns = ref_ns[i].to(torch.promote_types(dtypes[0], dtypes[1])).to(dtypes[2])
        torch.testing.assert_close(ns[i], want_ns, rtol=_one_ulp(dtypes[2]), atol=1e-30)


@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_skips_momentum_and_update(device, gen):
    grads, bufs, ns, params = _momentum_inputs(gen, device, MOMENTUM_DTYPES[0])
    before = [t.clone() for t in bufs + ns + params]
    found = torch.ones((), device=device)
    me.foreach_momentum_(grads, bufs, ns, params, momentum=0.9, nesterov=True, weight_decay=0.1,
                         weight_decay_method="l2", grad_scale=torch.tensor(2.0, device=device), found_inf=found)
    me.foreach_update_(params, [g.clone() for g in grads], [1.0] * len(grads), lr=0.1, weight_decay=0.1,
                       found_inf=found)
    for a, b in zip(before, bufs + ns + params):
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all())
    found.zero_()
    me.foreach_update_(params, [g.clone() for g in grads], [1.0] * len(grads), lr=0.1, found_inf=found)
    assert not torch.equal(params[2], before[2 * len(SHAPES) + 2])


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_param_and_grad_layouts_mixed(device, gen):
    # A transposed param with a contiguous gradient / buffer: same values as all-contiguous.
    p = _randn((37, 97), gen, torch.float32, device).t()
    g = _randn((97, 37), gen, torch.float32, device)
    buf = _randn((97, 37), gen, torch.float32, device)
    ns = torch.empty(97, 37, device=device)
    ref = [p.contiguous(), g.clone(), buf.clone(), ns.clone()]
    me.foreach_momentum_([g], [buf], [ns], [p], momentum=0.9, nesterov=True, weight_decay=0.1,
                         weight_decay_method="l2")
    me.foreach_momentum_([ref[1]], [ref[2]], [ref[3]], [ref[0]], momentum=0.9, nesterov=True, weight_decay=0.1,
                         weight_decay_method="l2")
    assert torch.equal(buf, ref[2]) and torch.equal(ns, ref[3])
    me.foreach_update_([p], [ns], [2.0], lr=0.1, weight_decay=0.1)
    me.foreach_update_([ref[0]], [ref[3]], [2.0], lr=0.1, weight_decay=0.1)
    assert torch.equal(p, ref[0]) and p.stride() == (1, 97)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_tensor_momentum_changes_without_recompiling(device, gen):
    # Warm-up schedules (nanochat, modded-nanogpt) change momentum every step.
    from torch._dynamo.utils import counters

    def step(grads, bufs, ns, momentum):
        me.foreach_momentum_(grads, bufs, ns, momentum=momentum, nesterov=True)

    grads, bufs, ns, _ = _momentum_inputs(gen, device, MOMENTUM_DTYPES[0], shapes=[(16, 8), (5,)])
    eager_bufs, eager_ns = [b.clone() for b in bufs], [n.clone() for n in ns]
    momentum = torch.tensor(0.85, device=device, dtype=torch.float64)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    for mu in (0.85, 0.9, 0.95):
        momentum.fill_(mu)
        compiled(grads, bufs, ns, momentum)
        step(grads, eager_bufs, eager_ns, mu)
    assert counters["stats"]["unique_graphs"] == 1
    for a, b in zip(bufs + ns, eager_bufs + eager_ns):
        assert torch.equal(a, b)


def test_empty_lists_are_a_no_op():
    me.foreach_momentum_([], [], [], momentum=0.9, nesterov=True)
    me.foreach_update_([], [], [], lr=0.1)
    ops.foreach_momentum_([], [], [], [], torch.tensor(0.9), False, torch.tensor(0.0), "decoupled")
    ops.foreach_update_([], [], [], torch.tensor(0.1), torch.tensor(0.0), "palm")


# ------------------------------------------------------------------ op contract
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["decoupled", "l2"])
@pytest.mark.parametrize("amp", [False, True])
def test_opcheck_foreach_momentum(device, method, amp, gen):
    grads, bufs, ns, params = _momentum_inputs(gen, device, MOMENTUM_DTYPES[1], shapes=[(4, 6), (0, 3), (5,)])
    mu = torch.tensor(0.9, device=device, dtype=torch.float64)
    wd = torch.tensor(0.1, device=device)
    scaler = (torch.tensor(1024.0, device=device), torch.zeros((), device=device)) if amp else (None, None)
    torch.library.opcheck(ops.foreach_momentum_.default,
                          (grads, bufs, ns, params if method == "l2" else [], mu, True, wd, method, *scaler))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_foreach_update(device, gen):
    params = [_randn(s, gen, torch.bfloat16, device) for s in [(4, 6), (0, 3), (5,)]]
    updates = [_randn(s, gen, torch.float32, device) for s in [(4, 6), (0, 3), (5,)]]
    lr = torch.tensor(0.1, device=device)
    wd = torch.tensor(0.01, device=device)
    torch.library.opcheck(ops.foreach_update_.default, (params, updates, [1.0, 2.0, 3.0], lr, wd, "palm"))
    torch.library.opcheck(ops.foreach_update_.default,
                          (params, updates, [1.0, 2.0, 3.0], lr, wd, "palm", torch.zeros((), device=device)))
    torch.library.opcheck(ops.foreach_update_.default, (params, updates, [1.0, 2.0, 3.0], lr, wd, "cautious"))
    torch.library.opcheck(ops.foreach_update_.default,
                          (params, updates, [1.0, 0.0, 3.0], lr, wd, "cautious", torch.zeros((), device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_tensor_lr_no_recompile(device, gen):
    def step(params, grads, bufs, ns, lr, wd):
        me.foreach_momentum_(grads, bufs, ns, momentum=0.9, nesterov=True, weight_decay=wd)
        me.foreach_update_(params, ns, [2.0] * len(params), lr=lr, weight_decay=wd)

    shapes = [(16, 8), (8, 3)]
    grads, bufs, ns, params = _momentum_inputs(gen, device, MOMENTUM_DTYPES[0], shapes=shapes)
    eager = [[t.clone() for t in ts] for ts in (params, grads, bufs, ns)]
    lr = torch.tensor(0.1, device=device)
    wd = torch.tensor(0.01, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    compiled(params, grads, bufs, ns, lr, wd)
    step(*eager, lr, wd)
    lr.fill_(0.05)
    wd.fill_(0.02)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(params, grads, bufs, ns, lr, wd)
    step(*eager, lr, wd)
    for got, want in zip(params + bufs, eager[0] + eager[2]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ bad input
def _bad_momentum_cases():
    f32, bf16 = torch.float32, torch.bfloat16
    ok = dict(dtypes=(f32, f32, f32), shapes=[(3, 4), (5,), (2, 2)], momentum=0.9, method="decoupled",
              wd=torch.tensor(0.1))

    def case(exc, match, **changes):
        return pytest.param({**ok, **changes}, exc, match, id=match)

    return [
        case(ValueError, "momentum_buffers has 2 tensors", drop="bufs"),
        case(ValueError, "ns_inputs has 2 tensors", drop="ns"),
        case(ValueError, "params must have one tensor per", method="l2", no_params=True),
        case(TypeError, "grads\\[0\\] is Double", dtypes=(torch.float64, f32, f32)),
        case(TypeError, "momentum_buffers\\[0\\] is BFloat16", dtypes=(f32, bf16, f32)),
        case(TypeError, "ns_inputs\\[0\\] is Half", dtypes=(f32, f32, torch.float16)),
        case(TypeError, "grads\\[2\\] is BFloat16 but grads\\[0\\] is Float", mix_grad=2),
        case(ValueError, "ns_inputs\\[2\\] has shape", bad_shape=2),
        case(ValueError, "momentum_buffers\\[1\\] has overlapping memory", overlapping=True),
        case(ValueError, "momentum must be finite and >= 0", momentum=-0.5),
        case(ValueError, "momentum must be finite and >= 0", momentum=float("inf")),
        case(ValueError, "momentum must be finite and >= 0", momentum=float("nan")),
        case(ValueError, "unknown weight_decay_method 'adamw'", method="adamw"),
        case(ValueError, "weight_decay must be a 0-dim float32 or float64 tensor", wd=torch.tensor([0.1])),
        case(TypeError, "weight_decay must be a 0-dim float32 or float64 tensor", wd=torch.tensor(1, dtype=torch.int32)),
        case(ValueError, "weight_decay must be finite", wd=torch.tensor(float("nan"))),
    ]


@pytest.mark.parametrize("spec,exc,match", _bad_momentum_cases())
def test_momentum_bad_input_mutates_nothing(spec, exc, match, gen):
    shapes = spec["shapes"]
    grads, bufs, ns, params = _momentum_inputs(gen, "cpu", spec["dtypes"], shapes=shapes)
    if spec.get("drop") == "bufs":
        bufs = bufs[:2]
    if spec.get("drop") == "ns":
        ns = ns[:2]
    if "mix_grad" in spec:
        grads[spec["mix_grad"]] = grads[spec["mix_grad"]].bfloat16()
    if "bad_shape" in spec:
        ns[spec["bad_shape"]] = torch.zeros(3, 3)
    if spec.get("overlapping"):
        bufs[1] = torch.randn(1, generator=gen).expand(5)
    if spec.get("no_params"):
        params = []
    snapshot = [t.clone() for t in grads + bufs + ns + params]
    with op_raises(exc, match):
        ops.foreach_momentum_(grads, bufs, ns, params, torch.tensor(spec["momentum"], dtype=torch.float64), True,
                              spec["wd"], spec["method"])
    # The Python wrapper rejects the same input (itself or through the op).
    with pytest.raises(exc, match=match):
        me.foreach_momentum_(grads, bufs, ns, params, momentum=spec["momentum"], nesterov=True,
                             weight_decay=spec["wd"], weight_decay_method=spec["method"])
    for before, after in zip(snapshot, grads + bufs + ns + params):
        assert torch.equal(before, after) or (before.isnan().all() and after.isnan().all())


def _bad_update_cases():
    ok = dict(param_dtype=torch.float32, update_dtype=torch.float32, scales=[1.0, 2.0, 3.0], method="decoupled",
              lr=torch.tensor(0.1), wd=torch.tensor(0.0))

    def case(exc, match, **changes):
        return pytest.param({**ok, **changes}, exc, match, id=match)

    return [
        case(ValueError, "scales has 2 values", scales=[1.0, 2.0]),
        case(ValueError, "scales\\[1\\] must be finite", scales=[1.0, float("inf"), 1.0]),
        case(ValueError, "updates has 2 tensors", drop_update=True),
        case(TypeError, "params\\[0\\] is Double", param_dtype=torch.float64),
        case(TypeError, "updates\\[0\\] is BFloat16", update_dtype=torch.bfloat16),
        case(ValueError, "updates\\[2\\] has shape", bad_shape=2),
        case(ValueError, "unknown weight_decay_method 'l1'", method="l1"),
        case(ValueError, "lr must be a 0-dim float32 or float64 tensor", lr=torch.tensor([0.1, 0.2])),
        case(TypeError, "weight_decay must be a 0-dim float32 or float64 tensor", wd=torch.tensor(0, dtype=torch.int32)),
        case(ValueError, "lr must be finite", lr=torch.tensor(float("nan"))),
        case(ValueError, "weight_decay must be finite", wd=torch.tensor(float("-inf"), dtype=torch.float64)),
    ]


@pytest.mark.parametrize("spec,exc,match", _bad_update_cases())
def test_update_bad_input_mutates_nothing(spec, exc, match, gen):
    shapes = [(3, 4), (5,), (2, 2)]
    params = [_randn(s, gen, spec["param_dtype"], "cpu") for s in shapes]
    updates = [_randn(s, gen, spec["update_dtype"], "cpu") for s in shapes]
    if spec.get("drop_update"):
        updates = updates[:2]
    if "bad_shape" in spec:
        updates[spec["bad_shape"]] = torch.zeros(2, 3)
    snapshot = [p.clone() for p in params]
    with op_raises(exc, match):
        ops.foreach_update_(params, updates, spec["scales"], spec["lr"], spec["wd"], spec["method"])
    with pytest.raises(exc, match=match):
        me.foreach_update_(params, updates, spec["scales"], lr=spec["lr"], weight_decay=spec["wd"],
                           weight_decay_method=spec["method"])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, params))


def test_wrapper_argument_types():
    g = [torch.zeros(2)]
    with pytest.raises(TypeError, match="grads must be a list"):
        me.foreach_momentum_(torch.zeros(2), g, g, momentum=0.9, nesterov=False)
    with pytest.raises(TypeError, match="momentum_buffers\\[0\\] must be a torch.Tensor"):
        me.foreach_momentum_(g, [1.0], g, momentum=0.9, nesterov=False)
    with pytest.raises(TypeError, match="lr must be a Python float or a 0-dim float32/float64 tensor"):
        me.foreach_update_(g, g, [1.0], lr="0.1")
    with pytest.raises(TypeError, match="scales\\[0\\] must be a float"):
        me.foreach_update_(g, g, [None], lr=0.1)
    with pytest.raises(ValueError, match="lr must be a 0-dim float32 or float64 tensor"):
        me.foreach_update_(g, g, [1.0], lr=torch.ones(1))
    with pytest.raises(ValueError, match="momentum must be finite"):
        me.foreach_momentum_(g, g, g, momentum=-0.1, nesterov=False)
    with pytest.raises(ValueError, match="lr must be finite"):
        me.foreach_update_(g, g, [1.0], lr=float("inf"))
    with pytest.raises(TypeError, match="found_inf must be None or a 0-dim tensor"):
        me.foreach_update_(g, g, [1.0], lr=0.1, found_inf=0.0)


@pytest.mark.gpu
def test_cuda_rejects_host_scalars_and_device_mix(gen):
    p = [torch.randn(4, 4, device="cuda")]
    u = [torch.randn(4, 4)]
    with op_raises(ValueError, "lr is on cpu but the tensor lists are on cuda"):
        ops.foreach_update_(p, [x.cuda() for x in u], [1.0], torch.tensor(0.1), torch.tensor(0.0, device="cuda"),
                            "decoupled")
    with op_raises(ValueError, "one device"):
        ops.foreach_update_(p, u, [1.0], torch.tensor(0.1, device="cuda"), torch.tensor(0.0, device="cuda"),
                            "decoupled")


# ------------------------------------------------------------------ CUDA specifics
@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", MOMENTUM_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("method", ["decoupled", "l2"])
def test_cuda_equals_cpu_bitwise(dtypes, method, gen):
    # Both backends evaluate the same shared math with the same explicit fmas and roundings.
    shapes = SHAPES + [(1, 3), (2, 65_537)]
    grads, bufs, ns, params = _momentum_inputs(gen, "cpu", dtypes, shapes=shapes)
    on_gpu = [[t.cuda() for t in ts] for ts in (grads, bufs, ns, params)]
    me.foreach_momentum_(grads, bufs, ns, params, momentum=0.95, nesterov=True, weight_decay=0.1,
                         weight_decay_method=method)
    me.foreach_momentum_(*on_gpu, momentum=0.95, nesterov=True, weight_decay=0.1, weight_decay_method=method)
    for a, b in zip(bufs + ns, on_gpu[1] + on_gpu[2]):
        assert torch.equal(a, b.cpu())
    updates = [n.float() for n in ns]
    scales = [1.0 + 0.25 * i for i in range(len(shapes))]
    me.foreach_update_(params, updates, scales, lr=0.01, weight_decay=0.1, weight_decay_method="palm")
    me.foreach_update_(on_gpu[3], [u.cuda() for u in updates], scales, lr=0.01, weight_decay=0.1,
                       weight_decay_method="palm")
    for a, b in zip(params, on_gpu[3]):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", UPDATE_DTYPES, ids=lambda d: "-".join(str(t)[6:] for t in d))
def test_cuda_cautious_update_equals_cpu_bitwise(dtypes, gen):
    shapes = CAUTIOUS_SHAPES + [(1, 3), (2, 65_537)]
    params = [_randn(s, gen, dtypes[0], "cpu") for s in shapes]
    updates = [_randn(s, gen, dtypes[1], "cpu") for s in shapes]
    on_gpu = [p.cuda() for p in params]
    scales = [1.0 + 0.25 * i for i in range(len(shapes))]
    me.foreach_update_(params, updates, scales, lr=0.01, weight_decay=0.7, weight_decay_method="cautious")
    me.foreach_update_(on_gpu, [u.cuda() for u in updates], scales, lr=0.01, weight_decay=0.7,
                       weight_decay_method="cautious")
    for a, b in zip(params, on_gpu):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_cuda_misaligned_stack_slices_equal_cpu_bitwise(ns_dtype, gen):
    # Slices i >= 1 of a (k, m, n) stack with odd m*n start off the 16-byte boundary: the kernel
    # peels a scalar head up to it and vectorizes the rest; values must not depend on the split.
    shape = (37, 129)
    grads, bufs, _, _ = _momentum_inputs(gen, "cpu", MOMENTUM_DTYPES[0], shapes=[shape] * 5)
    on_gpu = [[t.cuda() for t in ts] for ts in (grads, bufs)]
    stacked = torch.zeros(5, *shape, dtype=ns_dtype)
    stacked_gpu = stacked.cuda()
    assert stacked_gpu[1].data_ptr() % 16 != 0
    me.foreach_momentum_(grads, bufs, list(stacked.unbind(0)), momentum=0.9, nesterov=True)
    me.foreach_momentum_(*on_gpu, list(stacked_gpu.unbind(0)), momentum=0.9, nesterov=True)
    assert torch.equal(stacked, stacked_gpu.cpu())
    assert all(torch.equal(a, b.cpu()) for a, b in zip(bufs, on_gpu[1]))


@pytest.mark.gpu
def test_cuda_many_tensors_span_several_launches(gen):
    # More tensors than one kernel-argument table holds, misaligned views among them.
    base = torch.randn(400 * 37 + 1, device="cuda")
    grads = [base[1 + 37 * i: 1 + 37 * (i + 1)] if i % 3 == 0 else torch.randn(37, device="cuda")
             for i in range(400)]
    bufs = [torch.randn(37, device="cuda") for _ in range(400)]
    ns = [torch.empty(37, device="cuda") for _ in range(400)]
    ref_bufs, ref_ns = _momentum_mirror(grads, bufs, grads, 0.9, True, 0.0, "decoupled", torch.float32)
    me.foreach_momentum_(grads, bufs, ns, momentum=0.9, nesterov=True)
    for i in range(400):
        torch.testing.assert_close(bufs[i], ref_bufs[i], rtol=_one_ulp(torch.float32), atol=1e-30)
        torch.testing.assert_close(ns[i], ref_ns[i], rtol=_one_ulp(torch.float32), atol=1e-30)


@pytest.mark.gpu
def test_cuda_graph_capture_replays_with_new_lr(gen):
    params = [torch.randn(64, 32, device="cuda")]
    updates = [torch.randn(64, 32, device="cuda")]
    lr = torch.tensor(0.1, device="cuda")
    wd = torch.tensor(0.01, device="cuda")
    start = params[0].clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        me.foreach_update_(params, updates, [1.0], lr=lr, weight_decay=wd)  # warm-up
        torch.cuda.synchronize()
        params[0].copy_(start)
        with torch.cuda.graph(graph, stream=stream):
            me.foreach_update_(params, updates, [1.0], lr=lr, weight_decay=wd)
    torch.cuda.current_stream().wait_stream(stream)
    params[0].copy_(start)
    lr.fill_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    expected = start * (1 - 0.5 * 0.01) - 0.5 * updates[0]
    assert rel_err(params[0].cpu(), expected.cpu()) <= 1e-6


@pytest.mark.gpu
@pytest.mark.large_memory
def test_cuda_tensor_over_2_pow_31_elements(gen):
    n = 2**31 + 1000
    windows = [slice(0, 4096), slice(2**31 - 2048, 2**31 + 1000), slice(n - 777, n)]
    grads = [torch.randn(n, device="cuda", dtype=torch.bfloat16)]
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16)]
    params = [torch.randn(n, device="cuda", dtype=torch.bfloat16)]
    ns = [torch.empty(n, device="cuda", dtype=torch.bfloat16)]
    expected = [_momentum_mirror([grads[0][w]], [bufs[0][w]], [params[0][w]], 0.9, True, 0.1, "l2",
                                 torch.bfloat16) for w in windows]
    me.foreach_momentum_(grads, bufs, ns, params, momentum=0.9, nesterov=True, weight_decay=0.1,
                         weight_decay_method="l2")
    for w, (ref_buf, ref_ns) in zip(windows, expected):
        torch.testing.assert_close(bufs[0][w], ref_buf[0], rtol=_one_ulp(torch.bfloat16), atol=1e-30)
        torch.testing.assert_close(ns[0][w], ref_ns[0], rtol=_one_ulp(torch.bfloat16), atol=1e-30)
    del grads, bufs
    torch.cuda.empty_cache()
    p_windows = [params[0][w].clone() for w in windows]
    me.foreach_update_(params, ns, [2.0], lr=0.01, weight_decay=0.1, weight_decay_method="decoupled")
    for w, p0 in zip(windows, p_windows):
        mirror = _update_mirror(p0, ns[0][w], 2.0, 0.01, 0.1 * 0.01)
        torch.testing.assert_close(params[0][w], mirror, rtol=_one_ulp(torch.bfloat16), atol=1e-30)


def test_foreach_update_takes_a_scale_traced_as_a_symbol():
    """A compiled step may trace a float scale as a symbol (dynamo's automatic dynamic floats, after
    a recompile on a changed value): the argument checks must take it."""
    p = [torch.randn(4, 4)]
    u = [torch.randn(4, 4)]
    lr = torch.tensor(0.1, dtype=torch.float64)
    wd = torch.tensor(0.0, dtype=torch.float64)
    expected = p[0].clone()

    @torch.compile(fullgraph=True, backend="eager")
    def update(scale):
        ops.foreach_update_(p, u, [scale], lr=lr, weight_decay=wd, weight_decay_method="decoupled")

    torch._dynamo.reset()
    for scale in (1.5, 2.5, 3.5):
        update(scale)
        expected -= 0.1 * scale * u[0]
    torch.testing.assert_close(p[0], expected)
