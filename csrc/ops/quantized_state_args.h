// Argument checks of the low-memory state ops (foreach_momentum_quantized_,
// adamuon_normalize_quantized_), shared by the CPU and CUDA implementations. Every check runs
// before any tensor is written and names the op, the argument and the index. The result holds
// the backend-neutral arguments and the contiguous working copies of strided inputs.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "megatron_eopt/quantized_state_ops.h"
#include "ops/second_moment_args.h"
#include "ops/stable.h"

namespace megatron_eopt {

template <typename Args>
struct QuantizedCall {
  Args args;
  std::vector<Tensor> inputs;           // read-only contiguous copies, kept alive
  std::optional<InPlaceList> written;   // ns_inputs (momentum) or updates (second moment)

  void finish() const {
    if (written) written->write_back();
  }
};

QuantizedCall<QuantizedMomentumArgs> parse_foreach_momentum_quantized(
    const TensorList& grads, const TensorList& states, const TensorList& scales, const TensorList& ns_inputs,
    const TensorList& params, const Tensor& momentum, bool nesterov, const Tensor& weight_decay,
    const std::string& weight_decay_method, int64_t block_size, const Tensor& seed,
    const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf, const std::vector<int64_t>& draws,
    DeviceType backend);

QuantizedCall<QuantizedMoment2Args> parse_adamuon_normalize_quantized(
    const TensorList& updates, const TensorList& moment2, const TensorList& scales, const Tensor& beta2,
    const Tensor& eps, int64_t block_size, const Tensor& seed, const std::optional<Tensor>& found_inf,
    const std::vector<int64_t>& draws, DeviceType backend);

}  // namespace megatron_eopt
