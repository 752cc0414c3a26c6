"""How the CPU computes "medium"'s bf16 products (set_cpu_bf16_products): ATen's bf16 GEMMs, or fp32
GEMMs of the same bf16 values rounded to bf16 after each product. Both modes are tested on every
machine, whatever "auto" picks on it: each within the bf16 bound of float64 that the op's own
parity test applies, each in place bit for bit as out of place, and the fp32 mode really rounding
(as far from the fp32 iteration as the bf16 GEMMs, and returning bf16 values)."""

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.ops import newton_schulz
from megatron_eopt.ops._newton_schulz import _ns_arguments
from reference import TOLERANCE, bf16_input_tolerance, newton_schulz_ref, rel_err

SHAPES = [(1, 64), (64, 1), (97, 37), (37, 97), (48, 48), (3, 97, 37), (2, 20, 50)]


@pytest.fixture
def restore_mode():
    yield
    me.set_cpu_bf16_products("auto")


def test_the_setting_and_what_auto_resolves_to(restore_mode):
    info = me.cpu_bf16_products()
    assert info["mode"] == "auto"
    # "auto": what the product plan measured faster on this CPU (fp32 without bf16 instructions).
    assert info["products"] == (me.cpu_product_plan(2048)["in_use"]["medium"] if info["bf16_instructions"] else "fp32")
    for mode in ("bf16", "fp32"):
        me.set_cpu_bf16_products(mode)
        assert me.cpu_bf16_products() == {**info, "mode": mode, "products": mode}


@pytest.mark.parametrize("mode", [None, "medium", "BF16", 1])
def test_a_bad_mode_is_refused_and_the_setting_kept(mode, restore_mode):
    me.set_cpu_bf16_products("fp32")
    with pytest.raises(ValueError, match="set_cpu_bf16_products: mode"):
        me.set_cpu_bf16_products(mode)
    assert me.cpu_bf16_products()["mode"] == "fp32"


@pytest.mark.parametrize("mode", ["bf16", "fp32"])
@pytest.mark.parametrize("coefficient_type", ["quintic", "polar_express", "aol"])
@pytest.mark.parametrize("shape", SHAPES)
def test_both_modes_are_bf16_products_with_fp32_accumulation(mode, coefficient_type, shape, gen, restore_mode):
    me.set_cpu_bf16_products(mode)
    x = torch.randn(shape, generator=gen)
    out = newton_schulz(x, coefficient_type=coefficient_type, precision="medium", algorithm="standard")
    exact = newton_schulz_ref(x, coefficient_type=coefficient_type)
    recipe = newton_schulz_ref(x, coefficient_type=coefficient_type, dtype=torch.bfloat16)
    bound = max(TOLERANCE["medium"], bf16_input_tolerance(x, coefficient_type), 1.25 * rel_err(recipe, exact))
    assert rel_err(out, exact) <= bound
    coefficients, repeat_last = _ns_arguments(5, coefficient_type, None, 1e-7, "medium", "standard")
    args = (coefficients, 5, repeat_last, 1e-7, None, "medium", "standard")
    got = x.clone()
    torch.ops.megatron_eopt.newton_schulz_(got, *args)
    assert torch.equal(got, torch.ops.megatron_eopt.newton_schulz(x, *args))


@pytest.mark.parametrize("steps", [4, 5])
def test_the_fp32_mode_rounds_where_the_bf16_gemms_store(steps, gen, restore_mode):
    x = torch.randn(96, 160, generator=gen)
    fp32 = newton_schulz(x, steps=steps, precision="highest")
    me.set_cpu_bf16_products("bf16")
    bf16 = newton_schulz(x, steps=steps, precision="medium", algorithm="standard")
    me.set_cpu_bf16_products("fp32")
    emulated = newton_schulz(x, steps=steps, precision="medium", algorithm="standard")
    # Without rounding the emulated result would be the fp32 iteration's (about 1e-6 apart); with it,
    # it lies about as far from fp32 as the bf16 GEMMs' result (0.4-0.7% here; the two bf16 results
    # are as far apart, rounding some entries the other way).
    assert rel_err(emulated, fp32) > 1e-3
    assert 0.5 < rel_err(emulated, fp32) / rel_err(bf16, fp32) < 2.0
    # Every value it returns is a bf16 value (the last product's result, rounded).
    assert torch.equal(emulated, emulated.to(torch.bfloat16).float())
