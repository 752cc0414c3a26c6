// CUDA glue of the foreach momentum and update ops: shared checks, device guard, current stream;
// the work is in kernels/foreach_momentum.cu and kernels/foreach_update.cu. The per-step scalars
// stay on the device (read by the kernels), so nothing here synchronizes with the host.
#include <optional>
#include <string>

#include "megatron_eopt/foreach_cuda.h"
#include "cuda/cuda_context.h"
#include "ops/foreach_args.h"

namespace megatron_eopt {
namespace {

void foreach_momentum_cuda_op(const TensorList& grads, const TensorList& momentum_buffers, const TensorList& ns_inputs,
                              const TensorList& params, const Tensor& momentum, bool nesterov,
                              const Tensor& weight_decay, const std::string& weight_decay_method,
                              const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf) {
  const ForeachCall<ForeachMomentumArgs> call = parse_foreach_momentum(
      grads, momentum_buffers, ns_inputs, params, momentum, nesterov, weight_decay, weight_decay_method, grad_scale,
      found_inf, kCUDA);
  if (call.args.numels.empty()) return;
  const cuda::OpDevice device(grads[0]);
  foreach_momentum_cuda(call.args, device.stream);
  call.finish();
}

void foreach_update_cuda_op(const TensorList& params, const TensorList& updates, const std::vector<double>& scales,
                            const Tensor& lr, const Tensor& weight_decay, const std::string& weight_decay_method,
                            const std::optional<Tensor>& found_inf) {
  const ForeachCall<ForeachUpdateArgs> call = parse_foreach_update(params, updates, scales, lr, weight_decay,
                                                                   weight_decay_method, found_inf, kCUDA);
  if (call.args.numels.empty()) return;
  const cuda::OpDevice device(params[0]);
  foreach_update_cuda(call.args, device.stream);
  call.finish();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) {
  m.impl("foreach_momentum_", TORCH_BOX(&foreach_momentum_cuda_op));
  m.impl("foreach_update_", TORCH_BOX(&foreach_update_cuda_op));
}

}  // namespace megatron_eopt
