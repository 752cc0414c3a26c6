// Argument checks of the foreach momentum and update ops, shared by the CPU and CUDA
// implementations: every check runs before any tensor is written, and each failure names the op,
// the argument and the index. The result is the backend-neutral argument struct plus the
// contiguous working copies that stand in for tensors whose layout differs from the rest of their
// index (a transposed parameter next to its row-major Newton–Schulz input, say).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatron_eopt/foreach_ops.h"
#include "ops/aten_ops.h"
#include "ops/stable.h"

namespace megatron_eopt {

template <typename Args>
struct ForeachCall {
  Args args;
  std::vector<Tensor> inputs;                       // read-only working copies, kept alive
  std::vector<std::pair<Tensor, Tensor>> outputs;  // (caller's tensor, working copy)

  // After the kernels: copies the written working copies into the caller's tensors (stream-ordered
  // on CUDA). Nothing to do in the common case of one shared layout per index.
  void finish() const {
    for (auto [target, work] : outputs) aten::copy_(target, work);
  }
};

ForeachCall<ForeachMomentumArgs> parse_foreach_momentum(
    const TensorList& grads, const TensorList& momentum_buffers, const TensorList& ns_inputs, const TensorList& params,
    const Tensor& momentum, bool nesterov, const Tensor& weight_decay, const std::string& weight_decay_method,
    const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf, DeviceType backend);

ForeachCall<ForeachUpdateArgs> parse_foreach_update(const TensorList& params, const TensorList& updates,
                                                    const std::vector<double>& scales, const Tensor& lr,
                                                    const Tensor& weight_decay, const std::string& weight_decay_method,
                                                    const std::optional<Tensor>& found_inf, DeviceType backend);

// The per-step scalars of the momentum ops (0-dim fp32 / fp64 tensors on `device`; grad_scale and
// found_inf optional), their values checked on the CPU: momentum finite and >= 0, weight_decay finite.
struct MomentumScalars {
  StepScalar momentum;
  StepScalar weight_decay;
  StepScalar grad_scale;
  StepScalar found_inf;
};
MomentumScalars momentum_scalars(const char* op, const Tensor& momentum, const Tensor& weight_decay,
                                 const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf,
                                 const std::optional<Device>& device, DeviceType backend);

// Copies the scalars into a momentum op's launch arguments (the plain and the quantized op's
// argument structs name them alike).
template <typename Args>
void set_momentum_scalars(Args& args, const MomentumScalars& s) {
  args.momentum = s.momentum;
  args.weight_decay = s.weight_decay;
  args.grad_scale = s.grad_scale;
  args.found_inf = s.found_inf;
}

// A 0-dim float32 / float64 tensor on `device` (the lists' device; `backend` when there is none),
// as a StepScalar. Absent optional arguments give an empty StepScalar. Shared with the
// second-moment ops.
StepScalar step_scalar(const char* op, const char* name, const std::optional<Tensor>& t,
                       const std::optional<Device>& device, DeviceType backend, bool required = true);

}  // namespace megatron_eopt
