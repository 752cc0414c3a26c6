// Element loops of the CPU kernels are compiled twice on x86-64: for AVX2 + FMA (vectorized; fmaf
// in hardware) and for the baseline ISA (fmaf from libm, same results); the loader picks one per
// CPU. Every operation involved is correctly rounded in both, so the two clones agree bitwise.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__)
#define MEGATRON_EOPT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MEGATRON_EOPT_CPU_CLONES
#endif

// Before a loop whose iterations are independent although the compiler cannot prove it (a store
// through a narrow type may alias anything; an in-place update reads and writes one index): lets
// it vectorize without a runtime overlap check, whose failure would fall back to scalar code.
#if defined(__GNUC__) && !defined(__clang__)
#define MEGATRON_EOPT_NO_ALIAS _Pragma("GCC ivdep")
#elif defined(__clang__)
#define MEGATRON_EOPT_NO_ALIAS _Pragma("clang loop vectorize(assume_safety)")
#else
#define MEGATRON_EOPT_NO_ALIAS
#endif
