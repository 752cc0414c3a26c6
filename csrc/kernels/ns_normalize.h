// First pass of both Newton–Schulz algorithms on CUDA: per-matrix Frobenius norm (deterministic,
// no atomics) and the normalized copy of x in the compute type. Torch-free.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace megatron_eopt {

// Floats of the `partials` scratch ns_normalize_cast needs for `batch` matrices of `elems` each.
int64_t ns_norm_partial_slots(int64_t batch, int64_t elems);

// out[b, i] = x[b, i] / max(||x[b]||_F, eps), stored as fp32 or (out_bf16) bf16; x and out are
// contiguous (batch, elems). `partials` has ns_norm_partial_slots floats, `sum_squares` batch
// floats. Enqueued on `stream`, no host synchronisation.
void ns_normalize_cast(const float* x, void* out, bool out_bf16, int64_t batch, int64_t elems, float eps,
                       float* partials, float* sum_squares, cudaStream_t stream);

}  // namespace megatron_eopt
