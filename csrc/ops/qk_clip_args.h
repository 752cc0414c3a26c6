// Argument checks of qk_clip_, shared by the CPU and CUDA implementations.
#pragma once

#include <vector>

#include "ops/stable.h"

#include "megatron_eopt/qk_clip.h"

namespace megatron_eopt {

struct QkClipCall {
  std::vector<QkClipWeight> weights;  // weights without elements left out
  StorageType type = StorageType::kFloat32;
};

// Validates (ValueError / TypeError naming the argument, before anything is written) and returns
// the descriptors: weights 2-D float32 / bfloat16 / float16 of one dtype with contiguous rows;
// factors[i] 1-D float32 with rows_i / block_rows[i] values; one device of the backend's type.
QkClipCall parse_qk_clip(const TensorList& weights, const TensorList& factors, const std::vector<int64_t>& block_rows,
                         DeviceType backend);

}  // namespace megatron_eopt
