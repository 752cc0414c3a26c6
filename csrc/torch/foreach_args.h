// Argument checks of the foreach momentum and update ops, shared by the CPU and CUDA
// implementations: every check runs before any tensor is written, and each failure names the op,
// the argument and the index. The result is the backend-neutral argument struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include "megatron_eopt/foreach_ops.h"

namespace megatron_eopt {

ForeachMomentumArgs parse_foreach_momentum(at::TensorList grads, at::TensorList momentum_buffers,
                                           at::TensorList ns_inputs, at::TensorList params, double momentum,
                                           bool nesterov, const at::Tensor& weight_decay,
                                           c10::string_view weight_decay_method, c10::DeviceType backend);

ForeachUpdateArgs parse_foreach_update(at::TensorList params, at::TensorList updates, c10::ArrayRef<double> scales,
                                       const at::Tensor& lr, const at::Tensor& weight_decay,
                                       c10::string_view weight_decay_method, c10::DeviceType backend);

}  // namespace megatron_eopt
