"""The CPU Newton–Schulz paths this machine can run, for tests that run on each of them.

The product plan (megatron_eopt.cpu_product_plan) picks one path per size class by measurement;
tests pin each path in turn with the process-wide settings, so every path this CPU can run is
checked here, and the portable one (ATen's GEMMs, "gemm") on every CPU.
"""

from __future__ import annotations

import contextlib

import megatron_eopt

_SYMMETRIC = megatron_eopt.cpu_symmetric_products()["available"]

# Symmetric products (W·Wᵀ, G·G): ATen's GEMMs everywhere (on the lower column panels from side 512 on,
# or as one full GEMM), the AVX-512 kernel where it runs.
CPU_SYMMETRIC_PATHS = ["panels", "full"] + (["kernel"] if _SYMMETRIC["fp32"] else [])
# "medium"'s bf16 products: fp32 GEMMs of bf16 values everywhere; ATen's bf16 GEMMs where the CPU
# has bf16 instructions (elsewhere they are a scalar fallback, too slow to test at size).
CPU_BF16_PATHS = ["fp32"] + (["bf16"] if megatron_eopt.cpu_bf16_products()["bf16_instructions"] else [])
# The bf16 symmetric kernel runs only with bf16 products on a CPU with AVX512-BF16.
CPU_MEDIUM_PATHS = [(sym, bf16) for bf16 in CPU_BF16_PATHS for sym in CPU_SYMMETRIC_PATHS
                    if not (sym == "kernel" and bf16 == "bf16" and not _SYMMETRIC["bf16"])]


@contextlib.contextmanager
def cpu_path(symmetric: str = "auto", bf16: str = "auto"):
    """Pins the CPU products for the block, then returns to the measured choice."""
    megatron_eopt.set_cpu_symmetric_products(symmetric)
    megatron_eopt.set_cpu_bf16_products(bf16)
    try:
        yield
    finally:
        megatron_eopt.set_cpu_symmetric_products("auto")
        megatron_eopt.set_cpu_bf16_products("auto")


def describe() -> str:
    """One line per size class: what this CPU measured and runs (for the test log)."""
    lines = [f"CPU paths tested: symmetric {CPU_SYMMETRIC_PATHS}, medium products {CPU_BF16_PATHS}"]
    for side in (256, 768, 2048):
        plan = megatron_eopt.cpu_product_plan(side)
        ms = ", ".join(f"{k} {v:.2f}" for k, v in plan["ms"].items() if v is not None)
        lines.append(f"CPU product plan, probe {plan['probe']}: in use {plan['in_use']} (ms: {ms})")
    return "\n".join(lines)
