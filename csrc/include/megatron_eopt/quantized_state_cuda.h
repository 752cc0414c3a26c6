// CUDA launchers of the low-memory state ops: raw pointers and a stream only (the torch glue
// checks arguments and picks the device). One launch per 32 tensors; every per-step value (and
// the seed of the stochastic rounding) is read on the device, so the launches are graph-capturable.
#pragma once

#include <cuda_runtime_api.h>

#include "megatron_eopt/quantized_state_ops.h"

namespace megatron_eopt {

void foreach_momentum_quantized_cuda(const QuantizedMomentumArgs& args, cudaStream_t stream);
void adamuon_normalize_quantized_cuda(const QuantizedMoment2Args& args, cudaStream_t stream);

}  // namespace megatron_eopt
