// Host launcher of the QK-clip row scaling on CUDA (qk_clip.h). Raw pointers and a stream only.
#pragma once

#include <vector>

#include <cuda_runtime_api.h>

#include "megatron_eopt/qk_clip.h"

namespace megatron_eopt {

// Scales every weight of `weights` (all of storage type `type`, on the current device) by its row
// blocks' factors: one kernel per 32 weights, descriptors in the kernel arguments (no copies, CUDA
// graph safe), no host synchronisation.
void qk_clip_cuda(const std::vector<QkClipWeight>& weights, StorageType type, cudaStream_t stream);

}  // namespace megatron_eopt
