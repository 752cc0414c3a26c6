import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megatron_eopt as me
from megatron_eopt.newton_schulz import COEFFICIENT_SETS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(9, 5), (5, 9), (3, 8, 6)])
@pytest.mark.parametrize("precision", ["medium", "highest"])
def test_opcheck_newton_schulz(device, shape, precision, gen):
    x = torch.randn(shape, generator=gen).to(device)
    coeffs = [v for row in COEFFICIENT_SETS["quintic"] for v in row]
    torch.library.opcheck(torch.ops.megatron_eopt.newton_schulz.default,
                          (x, coeffs, 5, False, 1e-7, None, precision, "auto"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("products", ["symmetric", "full"])
def test_opcheck_products(device, products, gen):
    """The ops' products argument, through every op that takes it (the fake kernels included)."""
    coeffs = [v for row in COEFFICIENT_SETS["quintic"] for v in row]
    x = torch.randn(3, 8, 6, generator=gen).to(device)
    recipe = ("clamp", 1.0, False, False)
    ops = torch.ops.megatron_eopt
    torch.library.opcheck(ops.newton_schulz.default, (x, coeffs, 5, False, 1e-7, None, "medium", "auto", *recipe,
                                                      products))
    torch.library.opcheck(ops.newton_schulz_.default, (x.clone(), coeffs, 5, False, 1e-7, None, "highest", "auto",
                                                       *recipe, products))
    torch.library.opcheck(ops.newton_schulz_list.default, ([x[0], x[1]], coeffs, 5, False, 1e-7, None, "highest",
                                                           "auto", *recipe, products))
    torch.library.opcheck(ops.newton_schulz_split.default, (x, [2, 2], 2, coeffs, 5, False, 1e-7, None, "highest",
                                                            "spectral", 1.0, "auto", *recipe, products))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_newton_schulz_list(device, gen):
    xs = [torch.randn(s, generator=gen).to(device) for s in [(4, 6), (6, 4), (4, 6)]]
    coeffs = [v for row in COEFFICIENT_SETS["polar_express"] for v in row]
    torch.library.opcheck(torch.ops.megatron_eopt.newton_schulz_list.default,
                          (xs, coeffs, 9, True, 1e-7, True, "highest", "auto"))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_equals_eager(device, gen):
    def fn(x, y):
        return me.newton_schulz(x, precision="highest") * 2.0 + me.newton_schulz_list([y], precision="highest")[0]

    x = torch.randn(4, 24, 40, generator=gen).to(device)
    y = torch.randn(24, 40, generator=gen).to(device)
    compiled = torch.compile(fn, fullgraph=True)
    torch.testing.assert_close(compiled(x, y), fn(x, y))


def test_compiled_newton_schulz_follows_torchs_precision_setting(gen):
    # precision=None follows torch.get_float32_matmul_precision() as eager does, through changes of
    # it between calls: "medium" is bf16 products, 1e-2 off the fp32 ones, so a stale setting shows
    # (medium -> high does not change TF32 use, which dynamo's global-state guard watches)
    x = torch.randn(24, 40, generator=gen)
    before = torch.get_float32_matmul_precision()
    torch._dynamo.reset()
    compiled = torch.compile(lambda v: me.newton_schulz(v) * 1.0)
    try:
        for setting in ["highest", "medium", "high", "medium", "highest"]:
            torch.set_float32_matmul_precision(setting)
            assert torch.equal(compiled(x), me.newton_schulz(x, precision=setting)), setting
        # at torch's default the whole call is one graph
        torch.set_float32_matmul_precision("highest")
        torch._dynamo.reset()
        whole = torch.compile(lambda v: me.newton_schulz(v) * 1.0, fullgraph=True)
        assert torch.equal(whole(x), me.newton_schulz(x, precision="highest"))
    finally:
        torch.set_float32_matmul_precision(before)


def test_fake_tensor_mode_shapes():
    with FakeTensorMode():
        x = torch.empty(3, 17, 5)
        out = me.newton_schulz(x)
        assert out.shape == (3, 17, 5) and out.dtype == torch.float32
        outs = me.newton_schulz_list([torch.empty(2, 9), torch.empty(9, 2)])
        assert [o.shape for o in outs] == [(2, 9), (9, 2)]
