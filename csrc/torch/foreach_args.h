// Argument checks of the foreach momentum and update ops, shared by the CPU and CUDA
// implementations: every check runs before any tensor is written, and each failure names the op,
// the argument and the index. The result is the backend-neutral argument struct plus the
// contiguous working copies that stand in for tensors whose layout differs from the rest of their
// index (a transposed parameter next to its row-major Newton–Schulz input, say).
#pragma once

#include <optional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/string_view.h>

#include "megatron_eopt/foreach_ops.h"

namespace megatron_eopt {

template <typename Args>
struct ForeachCall {
  Args args;
  std::vector<at::Tensor> inputs;                          // read-only working copies, kept alive
  std::vector<std::pair<at::Tensor, at::Tensor>> outputs;  // (caller's tensor, working copy)

  // After the kernels: copies the written working copies into the caller's tensors (stream-ordered
  // on CUDA). Nothing to do in the common case of one shared layout per index.
  void finish() const {
    for (const auto& [target, work] : outputs) target.copy_(work);
  }
};

ForeachCall<ForeachMomentumArgs> parse_foreach_momentum(
    at::TensorList grads, at::TensorList momentum_buffers, at::TensorList ns_inputs, at::TensorList params,
    const at::Tensor& momentum, bool nesterov, const at::Tensor& weight_decay, c10::string_view weight_decay_method,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
    c10::DeviceType backend);

ForeachCall<ForeachUpdateArgs> parse_foreach_update(at::TensorList params, at::TensorList updates,
                                                    c10::ArrayRef<double> scales, const at::Tensor& lr,
                                                    const at::Tensor& weight_decay,
                                                    c10::string_view weight_decay_method,
                                                    const std::optional<at::Tensor>& found_inf,
                                                    c10::DeviceType backend);

// A 0-dim float32 / float64 tensor on `device` (the lists' device; `backend` when there is none),
// as a StepScalar. Absent optional arguments give an empty StepScalar. Shared with the
// second-moment ops.
StepScalar step_scalar(const char* op, const char* name, const std::optional<at::Tensor>& t,
                       std::optional<at::Device> device, c10::DeviceType backend, bool required = true);

}  // namespace megatron_eopt
