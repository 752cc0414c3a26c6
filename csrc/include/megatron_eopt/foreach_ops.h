// Backend-neutral arguments of the foreach momentum and update ops (raw pointers, element counts,
// storage types), as the torch glue hands them to the CPU loops and the CUDA launchers, and the
// storage-type dispatch both backends share.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "megatron_eopt/momentum_math.h"
#include "megatron_eopt/step_scalar.h"
#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

// foreach_momentum_: per tensor t, grads[t] (read), buffers[t] (read, written), ns_inputs[t]
// (written) and, for l2 weight decay only, params[t] (read); numels[t] elements each.
struct ForeachMomentumArgs {
  std::vector<const void*> grads;
  std::vector<void*> buffers;
  std::vector<void*> ns_inputs;
  std::vector<const void*> params;  // empty unless l2
  std::vector<int64_t> numels;
  StorageType grad_type = StorageType::kFloat32;  // also the params' type
  StorageType buffer_type = StorageType::kFloat32;
  StorageType ns_type = StorageType::kFloat32;
  bool nesterov = false;
  bool l2 = false;
  // 0-dim tensors' storage on the op's device, read by the kernels (momentum_coefficients()).
  StepScalar momentum;
  StepScalar weight_decay;
  StepScalar grad_scale;  // optional: gradients are divided by it
  StepScalar found_inf;   // optional: non-zero leaves every tensor untouched
};

// foreach_update_: params[t] (read, written), updates[t] (read), per-tensor scales[t].
struct ForeachUpdateArgs {
  std::vector<void*> params;
  std::vector<const void*> updates;
  std::vector<float> scales;
  std::vector<int64_t> numels;
  StorageType param_type = StorageType::kFloat32;
  StorageType update_type = StorageType::kFloat32;
  WeightDecayMethod method = WeightDecayMethod::kDecoupled;
  StepScalar lr;  // 0-dim tensors' storage, on the op's device
  StepScalar weight_decay;
  StepScalar found_inf;  // optional: non-zero leaves the parameters untouched
};

template <typename T>
struct TypeTag {
  using type = T;
};

// Parameters, gradients and momentum buffers: fp32, bf16 or fp16 (computed in fp32).
template <typename F>
decltype(auto) visit_param_type(StorageType type, F&& f) {
  if (type == StorageType::kBFloat16) return f(TypeTag<Bf16>{});
  if (type == StorageType::kFloat16) return f(TypeTag<Fp16>{});
  return f(TypeTag<float>{});
}

// Newton–Schulz inputs: fp32 or bf16 (the compute types of the NS op).
template <typename F>
decltype(auto) visit_ns_type(StorageType type, F&& f) {
  if (type == StorageType::kBFloat16) return f(TypeTag<Bf16>{});
  return f(TypeTag<float>{});
}

// Calls f(TypeTag<Grad>, TypeTag<Buffer>, TypeTag<Ns>, bool_constant<l2>) for the supported
// combinations: gradients fp32, bf16 or fp16, buffers in their type or fp32, NS inputs fp32 or bf16.
template <typename F>
void dispatch_momentum(const ForeachMomentumArgs& a, F&& f) {
  visit_param_type(a.grad_type, [&](auto grad_tag) {
    visit_param_type(a.buffer_type, [&](auto buffer_tag) {
      visit_ns_type(a.ns_type, [&](auto ns_tag) {
        using G = typename decltype(grad_tag)::type;
        using B = typename decltype(buffer_tag)::type;
        if constexpr (std::is_same_v<B, G> || std::is_same_v<B, float>) {
          if (a.l2) {
            f(grad_tag, buffer_tag, ns_tag, std::true_type{});
          } else {
            f(grad_tag, buffer_tag, ns_tag, std::false_type{});
          }
        } else {
          throw std::invalid_argument("foreach_momentum_: momentum buffers must be fp32 or the gradients' dtype");
        }
      });
    });
  });
}

// Calls f(TypeTag<Param>, TypeTag<Update>) for updates in fp32 or the parameters' type.
template <typename F>
void dispatch_update(const ForeachUpdateArgs& a, F&& f) {
  visit_param_type(a.param_type, [&](auto param_tag) {
    visit_param_type(a.update_type, [&](auto update_tag) {
      using P = typename decltype(param_tag)::type;
      using U = typename decltype(update_tag)::type;
      if constexpr (std::is_same_v<U, P> || std::is_same_v<U, float>) {
        f(param_tag, update_tag);
      } else {
        throw std::invalid_argument("foreach_update_: updates must be fp32 or the parameters' dtype");
      }
    });
  });
}

}  // namespace megatron_eopt
