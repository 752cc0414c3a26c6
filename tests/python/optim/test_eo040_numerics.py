"""Emerging-Optimizers 0.4.0 behaviours re-expressed in float32 (its source read at tag v0.4.0):
use_syrk on a batch, NorMuon's order of operations, and the custom-coefficient closeness check of
its tests/test_muon_utils.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megatron_eopt
from megatron_eopt import ops
from megatron_eopt.newton_schulz import get_muon_scale_factor

from cpu_paths import CPU_SYMMETRIC_PATHS


# ------------------------------------------------------------------ use_syrk
@pytest.mark.parametrize("precision", ["medium", None])
def test_use_syrk_refuses_a_batch_under_medium_as_eo(precision, gen):
    x = torch.randn(2, 16, 32, generator=gen)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # EO reads the global precision
    try:
        with pytest.raises(TypeError, match=r"^use_syrk does not support N-d input\..*\(2, 16, 32\)"):
            megatron_eopt.newton_schulz(x, 5, use_syrk=True, precision=precision)
        # a matrix, or a batch without use_syrk, runs
        assert megatron_eopt.newton_schulz(x[0], 5, use_syrk=True, precision=precision).shape == (16, 32)
        assert megatron_eopt.newton_schulz(x, 5, precision=precision).shape == (2, 16, 32)
    finally:
        torch.set_float32_matmul_precision(previous)
    # EO's other precisions never reach the SYRK branch: accepted there too
    assert megatron_eopt.newton_schulz(x, 5, use_syrk=True, precision="highest").shape == (2, 16, 32)


# ------------------------------------------------------------------ NorMuon
def _eo_normuon(o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float):
    """AdaptiveMuon._apply_moment2_normalization("normuon") of EO 0.4.0, at float32."""
    v = v.clone()
    avg_dim = -1 if o.shape[-2] >= o.shape[-1] else -2
    v.lerp_(o.square().mean(dim=avg_dim, keepdim=True), 1 - beta2)
    update = o * v.clamp_min(eps).rsqrt_()
    ratio = torch.linalg.vector_norm(o) / torch.linalg.vector_norm(update).clamp_min(eps)
    return update * ratio, v


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """fp32 square roots, correctly rounded (the CPU's sqrt instruction, through numpy): torch's
    vectorized CPU sqrt of float32 is not (it is 1 ulp off now and then, on 0-dim tensors too),
    while torch's rsqrt (1 / sqrt) and the sqrt that ends a vector_norm reduction are."""
    return torch.from_numpy(np.asarray(np.sqrt(x.contiguous().numpy()), dtype=np.float32))


def _eo_normuon_exact_sums(o: torch.Tensor, v: torch.Tensor, beta2: float, eps: float):
    """The same order of operations at float32, each reduction summed exactly (float64) and rounded
    once to float32; the square roots correctly rounded (as EO's rsqrt_ and vector_norm take them on
    the CPU). EO's fp32 sums depend on the CPU's vector width (torch's vectorized reduction order),
    so no kernel can reproduce them bit for bit on every machine; this is the order with the
    summation error removed."""
    v = v.clone()
    n = o.shape[-1] if o.shape[-2] >= o.shape[-1] else o.shape[-2]
    avg_dim = -1 if o.shape[-2] >= o.shape[-1] else -2
    v.lerp_(o.square().double().sum(dim=avg_dim, keepdim=True).float() / n, 1 - beta2)
    update = o * (1.0 / _sqrt_rn(v.clamp_min(eps)))  # rsqrt_: fl(1 / fl(sqrt(v)))
    norm_o = _sqrt_rn(o.double().square().sum().float())
    norm_u = _sqrt_rn(update.double().square().sum().float())
    return update * (norm_o / norm_u.clamp_min(eps)), v


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place (finite fp32 values)."""
    assert a.dtype == b.dtype == torch.float32
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


# Against EO's order with exact sums the op is bit for bit, v and the update (measured: 0 ulp on
# every shape below; 1 ulp allowed: the op's float64 sums run in another order than torch.sum's and
# could round to the other side of an fp32 midpoint). Against EO itself the difference is EO's own
# fp32 summation error, the distance between EO and the exact-sum re-expression (measured: (4, 16)
# 4 ulp, (128, 512) up to 20 ulp): torch reduces in fp32 in an order set by the CPU's vector width
# (8 AVX2 lanes, 16 AVX-512 lanes, then a serial sum of the lanes), which the op does not imitate.
@pytest.mark.parametrize("shape", [(4, 16), (16, 4), (7, 13), (13, 7), (64, 32), (32, 64), (97, 37), (1, 300),
                                   (300, 1), (1, 1), (128, 512)])
def test_normuon_follows_eo_order_of_operations(shape, gen):
    for _ in range(5):
        o = torch.randn(shape, generator=gen)
        stat = (shape[0], 1) if shape[0] >= shape[1] else (1, shape[1])
        v = torch.rand(stat, generator=gen) * 0.01
        exact, exact_v = _eo_normuon_exact_sums(o, v, 0.95, 1e-8)
        eo, _ = _eo_normuon(o, v, 0.95, 1e-8)
        got, got_v = o.clone(), v.clone()
        ops.normuon_normalize_([got], [got_v], beta2=0.95, eps=1e-8)
        assert _ulps(got_v, exact_v) <= 1 and _ulps(got, exact) <= 1, (shape, _ulps(got_v, exact_v),
                                                                        _ulps(got, exact))
        assert _ulps(got, eo) <= _ulps(exact, eo) + 1, shape


NORMUON_ULPS = 4  # the whole step on a (4, 16) param against EO at fp32: its 64-element fp32 sums, then lr-scaled


@pytest.mark.parametrize("shape", [(4, 16), (16, 4), (7, 13), (1, 9), (9, 1)])
def test_normuon_step_matches_eo(shape, gen):
    """The whole AdaptiveMuon step against EO's order (on our NS output): bit for bit with exact
    sums; on (4, 16) also against EO's fp32 sums, within their error."""
    p = torch.nn.Parameter(torch.randn(shape, generator=gen))
    q = p.detach().clone()
    q_exact = p.detach().clone()
    opt = megatron_eopt.optim.AdaptiveMuon([p], lr=0.02, momentum=0.95, weight_decay=0.0,
                                           moment2_method="normuon", fp32_matmul_prec="highest", nesterov=False)
    stat = (shape[0], 1) if shape[0] >= shape[1] else (1, shape[1])
    v, v_exact = torch.zeros(stat), torch.zeros(stat)
    buf = torch.zeros(shape)
    allowed = torch.zeros(shape)
    scale = get_muon_scale_factor(*shape, opt._config.scale_mode)
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        p.grad = g.clone()
        opt.step()
        buf.lerp_(g, 1 - 0.95)
        o = megatron_eopt.newton_schulz(buf, 5, precision="highest")
        # EO: update * scale_factor * extra_scale_factor, then p.add_(update, alpha=-lr)
        update, v_exact = _eo_normuon_exact_sums(o, v_exact, 0.95, 1e-8)
        q_exact.add_(update * scale * opt._config.extra_scale_factor, alpha=-0.02)
        assert torch.equal(opt.state[p]["moment2_buffer"], v_exact)
        assert torch.equal(p.detach(), q_exact), _ulps(p.detach(), q_exact)
        if shape != (4, 16):
            continue
        update, v = _eo_normuon(o, v, 0.95, 1e-8)
        update = update * scale * opt._config.extra_scale_factor
        before = q.clone()
        q.add_(update, alpha=-0.02)
        # in ulps of each step's larger operand, summed over the steps: where p - lr * update
        # cancels (p passing near 0) an update's last-place difference is many ulps of the small
        # result, and it stays in p for the later steps
        larger = torch.maximum(before.abs(), (0.02 * update).abs())
        allowed = allowed + NORMUON_ULPS * (torch.nextafter(larger, torch.tensor(float("inf"))) - larger)
        assert bool(((p.detach() - q).abs() <= allowed).all()), _ulps(p.detach(), q)


# ------------------------------------------------------------------ custom coefficients
def _eo_test_reference(x, coefficient_sets):
    """newton_schulz_ref of EO 0.4.0's tests/test_muon_utils.py, re-expressed."""
    transposed = x.size(-2) > x.size(-1)
    if transposed:
        x = x.mT
    X = x / x.norm(dim=(-2, -1), keepdim=True).clamp_min_(1e-7)
    for a, b, c in coefficient_sets:
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.mT if transposed else X


@pytest.mark.parametrize("symmetric", CPU_SYMMETRIC_PATHS)
@pytest.mark.parametrize("shape", [(511, 513), (511, 257), (257, 513)])
def test_custom_coefficients_close_to_eo_test_reference(shape, symmetric):
    """EO's test_newtonschulz_custom_coeff_close_to_reference: inputs 2**randint(-10, -5), the
    schedule (3, 5, 7), (11, 13, 17), highest precision. EO compares elementwise at rtol 1e-6 with
    its fp32 reference, i.e. with torch.mm's summation order; here both are measured against the same
    iteration in float64, and ours must be as close to it as the fp32 reference is (within 1.5x, or
    1e-6 where both are tiny), on every CPU path of the symmetric products."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    megatron_eopt.set_cpu_symmetric_products(symmetric)
    try:
        gen = torch.Generator().manual_seed(sum(shape))
        x = 2 ** torch.randint(-10, -5, shape, generator=gen).to(torch.float32)
        sets = [(3, 5, 7), (11, 13, 17)]
        out = megatron_eopt.newton_schulz(x, steps=2, coefficient_type="custom", custom_coefficient_sets=sets)
        exact = _eo_test_reference(x.double(), sets)
        ours = ((out.double() - exact).norm() / exact.norm()).item()
        fp32 = ((_eo_test_reference(x, sets).double() - exact).norm() / exact.norm()).item()
        print(f"{shape} {symmetric}: ours {ours:.2e}, fp32 torch.mm {fp32:.2e} from float64")
        assert ours <= max(1.5 * fp32, 1e-6), (ours, fp32)
    finally:
        megatron_eopt.set_cpu_symmetric_products("auto")
        torch.set_float32_matmul_precision(previous)
