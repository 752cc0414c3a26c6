// CUDA glue of the low-memory state ops: shared checks, device guard, current stream; the work is
// in kernels/quantized_state.cu. Nothing here synchronizes with the host.
#include <optional>
#include <string>
#include <vector>

#include "megatron_eopt/quantized_state_cuda.h"
#include "cuda/cuda_context.h"
#include "ops/quantized_state_args.h"

namespace megatron_eopt {
namespace {

void foreach_momentum_quantized_cuda_op(const TensorList& grads, const TensorList& states, const TensorList& scales,
                                        const TensorList& ns_inputs, const TensorList& params, const Tensor& momentum,
                                        bool nesterov, const Tensor& weight_decay,
                                        const std::string& weight_decay_method, int64_t block_size, const Tensor& seed,
                                        const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf,
                                        const std::vector<int64_t>& draws) {
  const auto call = parse_foreach_momentum_quantized(grads, states, scales, ns_inputs, params, momentum, nesterov,
                                                     weight_decay, weight_decay_method, block_size, seed, grad_scale,
                                                     found_inf, draws, kCUDA);
  if (call.args.tensors.empty()) return;
  const cuda::OpDevice device(grads[0]);
  foreach_momentum_quantized_cuda(call.args, device.stream);
  call.finish();
}

void adamuon_normalize_quantized_cuda_op(const TensorList& updates, const TensorList& moment2, const TensorList& scales,
                                         const Tensor& beta2, const Tensor& eps, int64_t block_size, const Tensor& seed,
                                         const std::optional<Tensor>& found_inf, const std::vector<int64_t>& draws) {
  const auto call = parse_adamuon_normalize_quantized(updates, moment2, scales, beta2, eps, block_size, seed, found_inf,
                                                      draws, kCUDA);
  if (call.args.tensors.empty()) return;
  const cuda::OpDevice device(updates[0]);
  adamuon_normalize_quantized_cuda(call.args, device.stream);
  call.finish();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) {
  m.impl("foreach_momentum_quantized_", TORCH_BOX(&foreach_momentum_quantized_cuda_op));
  m.impl("adamuon_normalize_quantized_", TORCH_BOX(&adamuon_normalize_quantized_cuda_op));
}

}  // namespace megatron_eopt
