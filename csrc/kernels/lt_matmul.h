// Strided-batched GEMM through cuBLASLt, D = alpha op(A) op(B) + beta C with C and D distinct,
// so scaled additions fold into the epilogue. Algorithms are chosen once per problem and cached.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_precision.h"

namespace megatron_eopt {

struct LtGemmArgs {
  const GemmShape* shape;
  int64_t batch;
  NsPrecision precision;  // element type and compute mode of A, B, C and D
  float alpha;
  const void* a;
  const void* b;
  float beta;
  const void* c;
  void* d;
};

// `device` is the current CUDA device (the caller's device guard set it): plans are per device.
void lt_strided_batched_gemm(const LtGemmArgs& args, int device, cublasLtHandle_t handle, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace megatron_eopt
