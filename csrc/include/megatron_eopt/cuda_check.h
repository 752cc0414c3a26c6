// Error checks for torch-free CUDA code. They throw std::runtime_error, which the torch
// dispatcher turns into a Python RuntimeError carrying the message.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

namespace megatron_eopt {

inline void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("megatron_eopt: ") + what + " failed at " + file + ":" + std::to_string(line) +
                             ": " + cudaGetErrorString(status));
  }
}

}  // namespace megatron_eopt

#define MEGATRON_EOPT_CUDA_CHECK(expr) ::megatron_eopt::check_cuda((expr), #expr, __FILE__, __LINE__)
// After every kernel launch: reports bad launch configurations at the launch site. As torch's
// C10_CUDA_KERNEL_LAUNCH_CHECK, it reads (and resets) the thread's last error, which may also be
// an earlier launch's that nobody checked: that failure is reported here rather than lost.
#define MEGATRON_EOPT_KERNEL_LAUNCH_CHECK()                                                                        \
  ::megatron_eopt::check_cuda(cudaGetLastError(), "kernel launch (or an earlier unchecked launch on this thread)", \
                              __FILE__, __LINE__)
