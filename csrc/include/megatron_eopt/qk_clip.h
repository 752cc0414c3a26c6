// QK-clip (MuonClip): rows of attention weights scaled per head, in place. A weight (rows x cols)
// is cut into blocks of `block_rows` consecutive rows (one attention head of a q, k or fused QKV
// projection); block b is multiplied by factors[b]. The factors (sqrt(tau / logit) and the like)
// are computed by the caller; the op does the memory-bound part for every weight of every layer
// in one pass. Torch-free: the descriptor the CPU loop and the CUDA kernel share.
#pragma once

#include <cstdint>
#include <vector>

#include "megatron_eopt/host_device.h"
#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

struct QkClipWeight {
  void* data;            // rows x cols, row stride `row_stride` elements, columns contiguous
  const float* factors;  // rows / block_rows values
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t block_rows;
};

// One element: the product in fp32, rounded once to the weight's dtype.
template <typename T>
MEGATRON_EOPT_HD T qk_clip_element(T w, float factor) {
  return from_float<T>(to_float(w) * factor);
}

}  // namespace megatron_eopt
