"""Newton–Schulz options of Emerging-Optimizers 0.4: precision from torch, steps=0, cubic5,
normalize_in_double, the 1e-15 eps floor, get_coefficient_iterator."""

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.newton_schulz import COEFFICIENT_SETS, get_coefficient_iterator
from reference import TOLERANCE, bf16_input_tolerance, newton_schulz_ref, ns_tolerance, rel_err


@pytest.fixture
def matmul_precision():
    """Sets torch's float32 matmul precision for one test and restores it afterwards."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_precision_follows_torch_when_not_given(precision, matmul_precision, gen):
    x = torch.randn(3, 37, 23, generator=gen)
    matmul_precision(precision)
    assert torch.equal(me.newton_schulz(x), me.newton_schulz(x, precision=precision))
    assert torch.equal(me.newton_schulz_list([x[0]])[0], me.newton_schulz_list([x[0]], precision=precision)[0])
    split = me.newton_schulz_split(x[0], [12, 25], 1)
    assert torch.equal(split, me.newton_schulz_split(x[0], [12, 25], 1, precision=precision))


def test_default_is_fp32_exact(gen):
    # torch's default precision is "highest": the default call meets the fp32 tolerance
    assert torch.get_float32_matmul_precision() == "highest"
    x = torch.randn(41, 29, generator=gen)
    assert rel_err(me.newton_schulz(x), newton_schulz_ref(x)) <= TOLERANCE["highest"]


@pytest.mark.parametrize("shape", [(1, 9), (9, 1), (97, 37), (2, 13, 13)])
def test_steps_zero_normalizes_only(shape, gen):
    x = torch.randn(shape, generator=gen) * 3.7
    out = me.newton_schulz(x, steps=0, precision="highest")
    ref = x.double() / x.double().norm(dim=(-2, -1), keepdim=True)
    assert rel_err(out, ref) <= TOLERANCE["highest"]
    medium = me.newton_schulz(x, steps=0, precision="medium")
    # the reference stores the normalized iterate in bf16: exactly representable there
    assert torch.equal(medium, medium.bfloat16().float())
    assert rel_err(medium, ref) <= 2 ** -8


@pytest.mark.parametrize("shape", [(97, 37), (37, 97), (3, 20, 20), (1, 40)])
def test_cubic5_parity_fp32(shape, gen):
    x = torch.randn(shape, generator=gen)
    out = me.newton_schulz(x, steps=5, coefficient_type="cubic5", precision="highest")
    ref = newton_schulz_ref(x, steps=5, coefficient_type="cubic5")
    assert rel_err(out, ref) <= ns_tolerance(x, "highest", "cpu", "cubic5")
    assert all(c == 0.0 for _, _, c in COEFFICIENT_SETS["cubic5"])


def test_cubic5_bf16(gen):
    x = torch.randn(64, 48, generator=gen)
    out = me.newton_schulz(x, coefficient_type="cubic5", precision="medium")
    ref = newton_schulz_ref(x, coefficient_type="cubic5", dtype=torch.bfloat16)
    assert rel_err(out, ref) <= bf16_input_tolerance(x, "cubic5")


def test_eps_floor_orthogonalizes_tiny_gradients(gen):
    # A gradient of norm 1e-9: 0.4's eps 1e-15 still normalizes it to unit norm, so it is
    # orthogonalized like any other; 0.3.0's 1e-7 leaves it at norm 1e-2, which five steps cannot lift.
    direction = torch.randn(32, 32, generator=gen)
    direction = direction / direction.norm()
    x = direction * 1e-9
    new = me.newton_schulz(x, precision="highest")
    old = me.newton_schulz(x, eps=1e-7, precision="highest")
    assert rel_err(new, newton_schulz_ref(x, eps=1e-15)) <= TOLERANCE["highest"]
    assert rel_err(old, newton_schulz_ref(x, eps=1e-7)) <= TOLERANCE["highest"]
    assert rel_err(new, newton_schulz_ref(direction)) <= TOLERANCE["highest"]
    assert old.norm() < 0.8 * new.norm()


def test_normalize_in_double_survives_float32_underflow(gen):
    # Entries of 1e-25: their squares underflow float32, so a float32 norm is 0 (then clamped);
    # the float64 norm is exact and the result is the orthogonalization of the direction.
    x = torch.randn(24, 40, generator=gen)
    tiny = x * 1e-25
    out = me.newton_schulz(tiny, normalize_in_double=True, precision="highest")
    assert rel_err(out, newton_schulz_ref(x)) <= TOLERANCE["highest"]
    plain = me.newton_schulz(tiny, precision="highest")
    assert rel_err(plain, newton_schulz_ref(x)) > 0.1
    steps0 = me.newton_schulz(tiny, steps=0, normalize_in_double=True, precision="highest")
    assert rel_err(steps0, x.double() / x.double().norm()) <= TOLERANCE["highest"]


def test_coefficient_iterator():
    rows = [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]
    assert list(get_coefficient_iterator(5, rows)) == [rows[0], rows[1], rows[0], rows[1], rows[0]]
    assert list(get_coefficient_iterator(4, rows, "repeat_last")) == [rows[0], rows[1], rows[1], rows[1]]
    assert list(get_coefficient_iterator(0, rows)) == []
    with pytest.raises(ValueError, match="non-empty"):
        get_coefficient_iterator(3, [])
    with pytest.raises(ValueError, match="Invalid mode"):
        get_coefficient_iterator(3, rows, "bounce")


def test_tp_without_partition_is_plain(gen):
    x = torch.randn(30, 20, generator=gen)
    out = me.newton_schulz_tp(x, 5, "quintic", tp_group=None, partition_dim=None)
    assert torch.equal(out, me.newton_schulz(x, 5, "quintic"))
