// CUDA launchers of the foreach momentum and update ops: raw pointers and a stream only (the torch
// glue checks arguments and picks the device). One multi-tensor launch per table of tensors.
#pragma once

#include <cuda_runtime_api.h>

#include "megatron_eopt/foreach_ops.h"

namespace megatron_eopt {

void foreach_momentum_cuda(const ForeachMomentumArgs& args, cudaStream_t stream);
void foreach_update_cuda(const ForeachUpdateArgs& args, cudaStream_t stream);

}  // namespace megatron_eopt
