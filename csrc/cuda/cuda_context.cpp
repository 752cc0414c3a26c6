#include "cuda/cuda_context.h"

#include "cuda/kernels/lt_matmul.h"

#include <array>
#include <mutex>
#include <string>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>

namespace megatron_eopt::cuda {
namespace {

constexpr int kMaxDevices = 64;

}  // namespace

cudaStream_t current_stream(int device) {
  void* stream = nullptr;
  MEGATRON_EOPT_SHIM_CHECK(aoti_torch_get_current_cuda_stream(device, &stream));
  return static_cast<cudaStream_t>(stream);
}

cublasLtHandle_t lt_handle(int device, cudaStream_t stream) {
  MEGATRON_EOPT_CHECK_VALUE(device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  // One handle per device, never destroyed: cuBLASLt handles are thread-safe, and destroying them
  // at exit would race the CUDA runtime's own teardown.
  static std::array<cublasLtHandle_t, kMaxDevices> handles{};
  static std::mutex mutex;
  const std::lock_guard<std::mutex> lock(mutex);
  if (handles[device] == nullptr) {
    if (stream_is_capturing(stream)) {
      // cublasLtCreate allocates and queries the device: not work to record into a graph.
      throw std::runtime_error("megatron_eopt: the first Newton-Schulz call on cuda:" + std::to_string(device) +
                               " is made while a CUDA graph is being captured. Run the same step (or op) once "
                               "before capturing it (a warm-up iteration on a side stream, as torch.cuda.graphs "
                               "recommends).");
    }
    const cublasStatus_t status = cublasLtCreate(&handles[device]);
    if (status != CUBLAS_STATUS_SUCCESS) {
      handles[device] = nullptr;
      throw std::runtime_error(std::string("megatron_eopt: cublasLtCreate failed on cuda:") + std::to_string(device) +
                               ": " + cublasLtGetStatusString(status));
    }
  }
  return handles[device];
}

cublasHandle_t blas_handle() {
  void* handle = nullptr;
  MEGATRON_EOPT_SHIM_CHECK(torch_get_current_cuda_blas_handle(&handle));
  return static_cast<cublasHandle_t>(handle);
}

}  // namespace megatron_eopt::cuda
