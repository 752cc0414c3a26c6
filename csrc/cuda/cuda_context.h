// What the CUDA glue takes from the running torch, through the stable C shim only: the current
// stream, torch's cuBLAS handle (the fallback GEMM path) and the device guard; plus a cuBLASLt
// handle per device of this library's own (torch's is not reachable through the stable ABI).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <torch/csrc/stable/accelerator.h>

#include "megatron_eopt/blas_context.h"
#include "ops/stable.h"

namespace megatron_eopt::cuda {

using DeviceGuard = torch::stable::accelerator::DeviceGuard;

// torch's current stream of `device` (what the caller's `with torch.cuda.stream(...)` selected).
cudaStream_t current_stream(int device);

// This library's cuBLASLt handle of `device`, created on first use and kept for the process. The
// first use must not be made while `stream` (the caller's current stream) captures a CUDA graph.
cublasLtHandle_t lt_handle(int device, cudaStream_t stream);

// torch's cuBLAS handle of the current device.
cublasHandle_t blas_handle();

// The device of a CUDA tensor (its index; the guard of an op call makes it current).
inline int device_of(const Tensor& t) { return static_cast<int>(t.get_device_index()); }

// The device an op call runs on, from one of its CUDA tensors: made current for the call (the
// guard restores the caller's on return), with torch's current stream there.
struct OpDevice {
  explicit OpDevice(const Tensor& t) : index(device_of(t)), guard(index), stream(current_stream(index)) {}
  int index;
  DeviceGuard guard;
  cudaStream_t stream;
};

// The GEMM context of an op call on `device` with its workspace provider.
inline LtContext blas_context(int device, LtWorkspace workspace) {
  const cudaStream_t stream = current_stream(device);
  return LtContext{device, lt_handle(device, stream), &blas_handle, workspace, stream};
}

}  // namespace megatron_eopt::cuda
