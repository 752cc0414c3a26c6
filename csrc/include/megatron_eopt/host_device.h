// MEGATRON_EOPT_HD marks the torch-free math that CUDA kernels and host code (CPU kernels,
// GoogleTest) share: __host__ __device__ and force-inlined under nvcc, plain inline elsewhere.
#pragma once

#ifdef __CUDACC__
#define MEGATRON_EOPT_HD __host__ __device__ __forceinline__
#else
#define MEGATRON_EOPT_HD inline
#endif

// a * b rounded on its own: never contracted into a following add or subtract (ptxas fuses
// a * b + c into one fma unless told otherwise; the CPU library is built with -ffp-contract=off).
MEGATRON_EOPT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
