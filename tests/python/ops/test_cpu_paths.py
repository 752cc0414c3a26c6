"""Every CPU path of the Newton–Schulz products, on every machine that can run it.

The product plan (megatron_eopt.cpu_product_plan) measures the candidates on the running CPU and
picks one per size class; these tests pin each path in turn (cpu_paths.py): ATen's GEMMs as upper
column panels or one full GEMM (the portable path, every CPU), the AVX-512 symmetric kernel (CPUs with
AVX-512), ATen's bf16 GEMMs (CPUs with bf16 instructions) and fp32 GEMMs of bf16 values. Each is
checked against float64, and fp32 products against torch.mm's own distance from float64.
"""

import os
import subprocess
import sys

import pytest
import torch

import megatron_eopt as me
from megatron_eopt.ops._newton_schulz import _ns_arguments

from cpu_paths import CPU_MEDIUM_PATHS, CPU_SYMMETRIC_PATHS, cpu_path
from reference import TOLERANCE, bf16_input_tolerance, newton_schulz_ref, ns_tolerance, rel_err

# Awkward shapes, and sides from 512 on where the symmetric products split into column panels.
SHAPES = [(1, 64), (64, 1), (97, 37), (37, 97), (3, 97, 37), (33, 130), (520, 530), (2, 130, 520), (2, 530, 517)]


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("symmetric", CPU_SYMMETRIC_PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_every_symmetric_path_close_to_float64(shape, symmetric, algorithm, gen):
    x = torch.randn(shape, generator=gen)
    with cpu_path(symmetric=symmetric):
        out = me.newton_schulz(x, precision="highest", algorithm=algorithm)
        coefficients, repeat_last = _ns_arguments(5, "quintic", None, 1e-7, "highest", algorithm)
        in_place = x.clone()
        torch.ops.megatron_eopt.newton_schulz_(in_place, coefficients, 5, repeat_last, 1e-7, None, "highest", algorithm)
    assert rel_err(out, newton_schulz_ref(x)) <= ns_tolerance(x, "highest", "cpu")
    assert torch.equal(in_place, out)


@pytest.mark.parametrize("algorithm", ["standard", "gram"])
@pytest.mark.parametrize("symmetric,bf16", CPU_MEDIUM_PATHS)
@pytest.mark.parametrize("shape", SHAPES)
def test_medium_every_path_close_to_float64(shape, symmetric, bf16, algorithm, gen):
    x = torch.randn(shape, generator=gen)
    with cpu_path(symmetric=symmetric, bf16=bf16):
        out = me.newton_schulz(x, precision="medium", algorithm=algorithm)
    exact = newton_schulz_ref(x)
    recipe = newton_schulz_ref(x, dtype=torch.bfloat16)
    bound = max(TOLERANCE["medium"], bf16_input_tolerance(x), 1.25 * rel_err(recipe, exact))
    assert rel_err(out, exact) <= bound


def _fp32_iteration(x, sets):
    """The plain fp32 iteration on torch.mm (EO's test reference), in x's dtype."""
    t = x.size(-2) > x.size(-1)
    X = x.mT if t else x
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-7)
    for a, b, c in sets:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if t else X


ACCURACY_SHAPES = [(1, 64), (64, 1), (97, 37), (37, 97), (257, 513), (511, 257), (511, 513), (600, 1100), (3, 40, 70)]


@pytest.mark.parametrize("symmetric", CPU_SYMMETRIC_PATHS)
@pytest.mark.parametrize("inputs", ["gaussian", "powers_of_two"])
def test_fp32_products_as_accurate_as_torch_mm(symmetric, inputs, gen):
    """Over awkward shapes, ours at "highest" lies no further from float64 than the same iteration on
    torch.mm in fp32: the summed error within 1.5x of torch's (individual cases vary by summation
    order both ways; on ATen's GEMMs, which torch.mm also runs, the sum measured 0.77x to 1.15x over
    30 draws of each kind of input, on the symmetric kernel 0.33x to 0.86x), and no case past 3x or
    the fp32 tolerance.
    Quintic, and EO's test schedule (3, 5, 7), (11, 13, 17)."""
    quintic = [tuple(row) for row in me.get_coefficients("quintic", 5)]
    ours_total = torch_total = 0.0
    with cpu_path(symmetric=symmetric):
        for shape in ACCURACY_SHAPES:
            if inputs == "gaussian":
                x = torch.randn(shape, generator=gen)
            else:  # EO 0.4's test inputs
                x = 2.0 ** torch.randint(-10, -5, shape, generator=gen).float()
            for sets in (quintic, [(3, 5, 7), (11, 13, 17)]):
                exact = _fp32_iteration(x.double(), sets)
                ours = me.newton_schulz(x, steps=len(sets), coefficient_type="custom", custom_coefficient_sets=sets,
                                        precision="highest", algorithm="standard")
                e_ours, e_torch = rel_err(ours, exact), rel_err(_fp32_iteration(x, sets), exact)
                print(f"{inputs} {shape} {len(sets)} steps: ours {e_ours:.2e}, torch.mm {e_torch:.2e}")
                assert e_ours <= max(3 * e_torch, TOLERANCE["highest"]), (shape, sets, e_ours, e_torch)
                ours_total += e_ours
                torch_total += e_torch
    print(f"summed: ours {ours_total:.3e}, torch.mm {torch_total:.3e}")
    assert ours_total <= 1.5 * torch_total, (ours_total, torch_total)


def test_paths_agree_to_rounding(gen):
    """The paths differ by summation order only: pairwise within a few fp32 roundings' effect."""
    x = torch.randn(300, 700, generator=gen)
    results = {}
    for symmetric in CPU_SYMMETRIC_PATHS:
        with cpu_path(symmetric=symmetric):
            results[symmetric] = me.newton_schulz(x, precision="highest", algorithm="standard")
    first = next(iter(results.values()))
    for name, out in results.items():
        assert rel_err(out, first) <= 1e-5, name


def test_plan_reports_measured_choices():
    """The plan reports its probe times and the choices made from them (the rules themselves are
    tested on made-up timings in tests/cpp/test_cpu_product_choice.cpp)."""
    for side in (64, 383, 384, 1535, 1536, 4096):
        plan = me.cpu_product_plan(side)
        assert plan["probe"] == ((256, 512) if side < 384 else (768, 1536) if side < 1536 else (1536, 1536))
        ms = plan["ms"]
        assert ms["fp32_general"] > 0 and ms["fp32_full"] > 0
        # Row panels exist from side 512 on: timed for the large probe only.
        assert (ms["fp32_panels"] is None) == (side < 384)
        measured = plan["measured"]
        panels = ms["fp32_panels"] is not None and ms["fp32_panels"] < ms["fp32_full"]
        assert measured["gemm_fp32"] == ("panels" if panels else "full")
        gemm = ms["fp32_panels"] if panels else ms["fp32_full"]
        if ms["fp32_kernel"] is None:
            assert measured["symmetric_fp32"] == "gemm"
        else:
            assert measured["symmetric_fp32"] == ("kernel" if ms["fp32_kernel"] < gemm else "gemm")
        if ms["bf16_general"] is None:  # no bf16 instructions: fp32 products, nothing timed
            assert measured["medium"] == "fp32" and plan["bf16_speedup"] == 1.0
        elif measured["medium"] == "bf16":
            # "medium" takes bf16 GEMMs only where they measured faster than fp32 ones.
            assert plan["bf16_speedup"] > 1.0
        assert plan["in_use"] == {k: measured[k] for k in ("symmetric_fp32", "symmetric_bf16", "medium")}


def test_settings_override_the_plan_and_are_checked():
    available = me.cpu_symmetric_products()["available"]
    try:
        me.set_cpu_symmetric_products("gemm")
        assert me.cpu_symmetric_products() == {"fp32": False, "bf16": False, "available": available, "mode": "gemm"}
        me.set_cpu_symmetric_products("kernel")
        info = me.cpu_symmetric_products()
        assert (info["fp32"], info["bf16"]) == (available["fp32"], available["bf16"])
        me.set_cpu_bf16_products("fp32")
        assert me.cpu_product_plan(2048)["in_use"]["medium"] == "fp32"
        for bad in ("AVX512", None, 1):
            with pytest.raises(ValueError, match="set_cpu_symmetric_products: mode"):
                me.set_cpu_symmetric_products(bad)
        assert me.cpu_symmetric_products()["mode"] == "kernel"
    finally:
        me.set_cpu_symmetric_products("auto")
        me.set_cpu_bf16_products("auto")


CHILD = r"""
import torch, megatron_eopt as me
gen = torch.Generator().manual_seed(7)
x = torch.randn(130, 300, generator=gen)
print(me.cpu_symmetric_products()["fp32"], me.cpu_bf16_products()["products"])
torch.save(me.newton_schulz(x, precision="highest"), __import__("sys").argv[1])
"""


def test_the_environment_forces_the_portable_path(tmp_path):
    """MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS=gemm and MEGATRON_EOPT_CPU_BF16_PRODUCTS=fp32 from the
    start of a process: ATen's GEMMs only, the same result as the setting gives."""
    env = dict(os.environ, MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS="gemm", MEGATRON_EOPT_CPU_BF16_PRODUCTS="fp32")
    path = tmp_path / "out.pt"
    done = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "fp32"]
    x = torch.randn(130, 300, generator=torch.Generator().manual_seed(7))
    with cpu_path(symmetric="gemm"):
        assert torch.equal(torch.load(path), me.newton_schulz(x, precision="highest"))


def test_a_bad_environment_value_is_refused_at_import():
    env = dict(os.environ, MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS="avx512")
    done = subprocess.run([sys.executable, "-c", "import megatron_eopt"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert "MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS must be one of" in done.stderr
