// CUDA glue of the foreach momentum and update ops: shared checks, device guard, current stream;
// the work is in kernels/foreach_momentum.cu and kernels/foreach_update.cu. The per-step scalars
// stay on the device (read by the kernels), so nothing here synchronizes with the host.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "megatron_eopt/foreach_cuda.h"
#include "torch/foreach_args.h"

namespace megatron_eopt {
namespace {

void foreach_momentum_cuda_op(at::TensorList grads, at::TensorList momentum_buffers, at::TensorList ns_inputs,
                              at::TensorList params, const at::Tensor& momentum, bool nesterov,
                              const at::Tensor& weight_decay, c10::string_view weight_decay_method,
                              const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf) {
  const ForeachCall<ForeachMomentumArgs> call =
      parse_foreach_momentum(grads, momentum_buffers, ns_inputs, params, momentum, nesterov, weight_decay,
                             weight_decay_method, grad_scale, found_inf, c10::kCUDA);
  if (call.args.numels.empty()) return;
  const c10::cuda::OptionalCUDAGuard guard(grads[0].device());
  foreach_momentum_cuda(call.args, c10::cuda::getCurrentCUDAStream());
  call.finish();
}

void foreach_update_cuda_op(at::TensorList params, at::TensorList updates, c10::ArrayRef<double> scales,
                            const at::Tensor& lr, const at::Tensor& weight_decay,
                            c10::string_view weight_decay_method, const std::optional<at::Tensor>& found_inf) {
  const ForeachCall<ForeachUpdateArgs> call =
      parse_foreach_update(params, updates, scales, lr, weight_decay, weight_decay_method, found_inf, c10::kCUDA);
  if (call.args.numels.empty()) return;
  const c10::cuda::OptionalCUDAGuard guard(params[0].device());
  foreach_update_cuda(call.args, c10::cuda::getCurrentCUDAStream());
  call.finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) {
  m.impl("foreach_momentum_", &foreach_momentum_cuda_op);
  m.impl("foreach_update_", &foreach_update_cuda_op);
}

}  // namespace megatron_eopt
