// MEGATRON_EOPT_HD marks the torch-free math that CUDA kernels and host code (CPU kernels,
// GoogleTest) share: __host__ __device__ and force-inlined under nvcc, plain inline elsewhere.
#pragma once

#ifdef __CUDACC__
#define MEGATRON_EOPT_HD __host__ __device__ __forceinline__
#else
#define MEGATRON_EOPT_HD inline
#endif
