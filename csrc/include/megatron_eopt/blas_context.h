// What the CUDA launchers need to run GEMMs, passed in by the torch glue: handles, the stream and
// a workspace provider. Torch-free.
#pragma once

#include <cstddef>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "megatron_eopt/ns_products.h"

namespace megatron_eopt {

// Device workspace for the GEMMs of one op call: get(context, bytes) returns at least `bytes` of
// device memory usable in stream order on the call's stream. The glue backs it with torch's
// caching allocator, so a call holds what its chosen algorithms need instead of a fixed maximum.
struct LtWorkspace {
  void* context;
  void* (*get)(void* context, std::size_t bytes);
};

// Everything a GEMM needs besides its operands. `device` is the current CUDA device (the caller's
// device guard set it): plans are per device.
struct LtContext {
  int device;
  cublasLtHandle_t lt;
  // The fallback's handle, fetched only when a GEMM takes the fallback: torch's getter rebinds
  // the handle's stream and workspace, host work every call would otherwise pay.
  cublasHandle_t (*blas)();
  LtWorkspace workspace;
  cudaStream_t stream;
  // How the call's symmetric products run (the ops' `products` argument; lt_symmetric.h).
  NsProducts products = NsProducts::kAuto;
};

}  // namespace megatron_eopt
