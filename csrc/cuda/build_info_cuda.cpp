// Build facts and process-wide switches of the CUDA library (read and set with ctypes by
// megatron_eopt._library and the doctor).
#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/kernels/lt_matmul.h"
#include "cuda/kernels/lt_symmetric.h"
#include "ops/c_export.h"

// CUDA runtime version of the build, e.g. 13000.
MEGATRON_EOPT_C_EXPORT int megatron_eopt_cuda_version_built() { return CUDART_VERSION; }

// CMake's CUDA architecture list of the build, comma-separated ("80-real,90-real,100": machine
// code for 80 and 90, PTX and machine code for 100).
MEGATRON_EOPT_C_EXPORT const char* megatron_eopt_cuda_archs_built() { return MEGATRON_EOPT_CUDA_ARCH_LIST; }

// GEMMs run so far by cuBLASLt and by the cuBLAS fallback (process-wide).
MEGATRON_EOPT_C_EXPORT void megatron_eopt_gemm_counts(int64_t* lt_calls, int64_t* fallback_calls) {
  const megatron_eopt::LtGemmCounts counts = megatron_eopt::lt_gemm_counts();
  *lt_calls = counts.lt_calls;
  *fallback_calls = counts.fallback_calls;
}

// Nonzero: every GEMM takes the cuBLAS fallback until called again with 0.
MEGATRON_EOPT_C_EXPORT void megatron_eopt_force_blas_fallback(int on) { megatron_eopt::lt_force_fallback(on != 0); }

// The rule for Newton–Schulz products with a symmetric result (kernels/lt_symmetric.h): max_blocks
// 1 runs them as full GEMMs, 0 returns to the measured default.
MEGATRON_EOPT_C_EXPORT void megatron_eopt_set_symmetric_panels(int64_t max_blocks, int64_t min_panel) {
  megatron_eopt::set_symmetric_panel_rule({max_blocks, min_panel});
}

MEGATRON_EOPT_C_EXPORT void megatron_eopt_symmetric_panels(int64_t* max_blocks, int64_t* min_panel) {
  const megatron_eopt::SymmetricPanelRule rule = megatron_eopt::symmetric_panel_rule();
  *max_blocks = rule.max_blocks;
  *min_panel = rule.min_panel;
}
