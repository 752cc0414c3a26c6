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

// Process-wide setting (megatron_eopt.set_cpu_bf16_products), kAuto at start.
void set_cpu_bf16_products(CpuBf16Products mode);
CpuBf16Products cpu_bf16_products();

// The setting resolved: true for ATen's bf16 GEMMs (kBf16, or kAuto on a CPU with bf16
// instructions), false for fp32 GEMMs of bf16 values.
bool cpu_uses_bf16_gemms();

}  // namespace megatron_eopt
