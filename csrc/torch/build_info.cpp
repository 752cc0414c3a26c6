// Build facts for the Python front and `python -m megatron_eopt.doctor`: plain C functions read
// with ctypes (no op, no tensors), so they answer even where an op would fail to run.
#include <torch/version.h>

#ifdef MEGATRON_EOPT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#define MEGATRON_EOPT_STR2(x) #x
#define MEGATRON_EOPT_STR(x) MEGATRON_EOPT_STR2(x)

extern "C" int megatron_eopt_cuda_kernels_built() {
#ifdef MEGATRON_EOPT_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

// "major.minor.patch" of the torch headers the library was compiled against.
extern "C" const char* megatron_eopt_torch_version_built() {
  return MEGATRON_EOPT_STR(TORCH_VERSION_MAJOR) "." MEGATRON_EOPT_STR(TORCH_VERSION_MINOR) "." MEGATRON_EOPT_STR(
      TORCH_VERSION_PATCH);
}

// CUDA runtime version of the build (e.g. 13000), 0 for a CPU-only build.
extern "C" int megatron_eopt_cuda_version_built() {
#ifdef MEGATRON_EOPT_WITH_CUDA
  return CUDART_VERSION;
#else
  return 0;
#endif
}

// CMake's CUDA architecture list of the build ("80-real,90-real,100": SASS for 80 and 90, PTX and
// SASS for 100), empty for a CPU-only build.
extern "C" const char* megatron_eopt_cuda_archs_built() {
#ifdef MEGATRON_EOPT_CUDA_ARCH_LIST
  return MEGATRON_EOPT_CUDA_ARCH_LIST;
#else
  return "";
#endif
}
