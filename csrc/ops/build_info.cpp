// Build facts of the CPU library for the Python front and `python -m megatron_eopt.doctor`: plain
// C functions read with ctypes (no op, no tensors). The CUDA library reports its own
// (csrc/cuda/build_info_cuda.cpp).
#include <torch/headeronly/version.h>

#include "ops/c_export.h"

#define MEGATRON_EOPT_STR2(x) #x
#define MEGATRON_EOPT_STR(x) MEGATRON_EOPT_STR2(x)

// "major.minor.patch" of the torch headers the library was compiled against.
MEGATRON_EOPT_C_EXPORT const char* megatron_eopt_torch_version_built() {
  return MEGATRON_EOPT_STR(TORCH_VERSION_MAJOR) "." MEGATRON_EOPT_STR(TORCH_VERSION_MINOR) "." MEGATRON_EOPT_STR(
      TORCH_VERSION_PATCH);
}

// "major.minor" of the oldest torch the libraries load on (the stable-ABI target version).
MEGATRON_EOPT_C_EXPORT const char* megatron_eopt_torch_floor() { return MEGATRON_EOPT_TORCH_FLOOR; }
