// How the CPU Newton–Schulz computes the bf16 products of "medium": ATen's bf16 GEMMs (oneDNN),
// or fp32 GEMMs of the same bf16 values with each result rounded to bf16 where the bf16 GEMM
// would store it. Both are bf16 products with fp32 accumulation (a product of two bf16 values is
// exact in fp32), so they differ by summation order only. oneDNN's bf16 GEMMs are fast where the
// CPU has bf16 instructions (AVX512-BF16, AMX) and a scalar fallback elsewhere: one 2048 x 8192 x
// 2048 product took 219 s on an AVX2 EPYC, against 0.48 s in fp32 (benchmarks/RESULTS.md).
#pragma once

namespace megatron_eopt {

enum class CpuBf16Products { kAuto = 0, kBf16 = 1, kFp32 = 2 };

// Whether this CPU has bf16 GEMM instructions its OS enables (x86-64: AVX512-BF16 with AVX-512
// state, or AMX-BF16 with tile state; Linux on aarch64: the BF16 extension); detected once. False
// elsewhere, where fp32 GEMMs of bf16 values are the safe choice.
bool cpu_has_bf16_instructions();

// Process-wide setting (megatron_eopt.set_cpu_bf16_products); at start, the environment variable
// MEGATRON_EOPT_CPU_BF16_PRODUCTS (auto, bf16 or fp32), else kAuto.
void set_cpu_bf16_products(CpuBf16Products mode);
CpuBf16Products cpu_bf16_products();

// What "auto" resolves to is measured per size class (cpu_product_plan.h: cpu_uses_bf16_gemms).

}  // namespace megatron_eopt
