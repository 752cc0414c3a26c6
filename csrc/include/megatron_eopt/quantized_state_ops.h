// Backend-neutral arguments and per-element steps of the ops that keep optimizer state in a
// low-memory format (state_quantization.h): the momentum step (foreach_momentum_quantized_) and
// AdaMuon's second moment (adamuon_normalize_quantized_). The CPU loops and the CUDA kernels walk
// the same blocks and call the same functions below, so both store the same bits.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "megatron_eopt/foreach_ops.h"
#include "megatron_eopt/momentum_math.h"
#include "megatron_eopt/second_moment_math.h"
#include "megatron_eopt/state_quantization.h"
#include "megatron_eopt/step_scalar.h"
#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

// One tensor of a list: the fp32 tensors and the state, all numel elements in row-major order.
struct QuantizedStateTensor {
  const void* grad = nullptr;   // momentum: the gradient (grad_type)
  const void* param = nullptr;  // momentum with l2 decay: the parameter (grad_type)
  void* ns_input = nullptr;     // momentum: the Newton–Schulz input written (ns_type)
  float* update = nullptr;      // second moment: the raw Newton–Schulz output, normalized in place
  void* state = nullptr;        // bf16, int8 or e4m3 codes
  float* scales = nullptr;      // int8 / fp8: one per block (BlockLayout); bf16: none
  int64_t numel = 0;
  int64_t row_len = 1;          // the state's last dimension: blocks never span two rows
  uint64_t stream = 0;          // draw_stream() of this tensor and state kind
  DrawIndex draw;               // each element's index in its whole parameter, for its draw
};

struct QuantizedMomentumArgs {
  std::vector<QuantizedStateTensor> tensors;
  StorageType grad_type = StorageType::kFloat32;
  StorageType ns_type = StorageType::kFloat32;
  StateFormat format = StateFormat::kInt8;  // fp8 momentum: kFloat8E4M3Squared
  int64_t block_size = 256;
  bool nesterov = false;
  bool l2 = false;
  StepScalar momentum;
  StepScalar weight_decay;
  StepScalar grad_scale;  // optional
  StepScalar found_inf;   // optional: non-zero leaves every tensor untouched
  const int64_t* seed = nullptr;  // 0-dim int64 on the op's device: the step's draws
};

struct QuantizedMoment2Args {
  std::vector<QuantizedStateTensor> tensors;
  StateFormat format = StateFormat::kFloat8E4M3;  // kBFloat16: v itself; kFloat8E4M3: sqrt(v)
  int64_t block_size = 256;
  Moment2Scalars scalars;  // beta2, eps, found_inf
  const int64_t* seed = nullptr;
};

// ---- reading and writing one state element ----
template <StateFormat F>
MEGATRON_EOPT_HD float load_state(const void* data, int64_t i, float scale) {
  if constexpr (F == StateFormat::kBFloat16) {
    return to_float(static_cast<const Bf16*>(data)[i]);
  } else if constexpr (F == StateFormat::kInt8) {
    return int8_value(static_cast<const int8_t*>(data)[i], scale);
  } else if constexpr (F == StateFormat::kFloat8E4M3Squared) {
    return e4m3_squared_value(static_cast<const Fp8E4M3*>(data)[i], scale);
  } else {
    return e4m3_value(static_cast<const Fp8E4M3*>(data)[i], scale);
  }
}

template <StateFormat F>
MEGATRON_EOPT_HD void store_state(void* data, int64_t i, float x, float inverse, uint32_t bits) {
  if constexpr (F == StateFormat::kBFloat16) {
    static_cast<Bf16*>(data)[i] = bf16_stochastic(x, bits);
  } else if constexpr (F == StateFormat::kInt8) {
    static_cast<int8_t*>(data)[i] = int8_stochastic(x, inverse, uniform_from_bits(bits));
  } else if constexpr (F == StateFormat::kFloat8E4M3Squared) {
    static_cast<Fp8E4M3*>(data)[i] = e4m3_squared_stochastic(x, inverse, uniform_from_bits(bits));
  } else {
    static_cast<Fp8E4M3*>(data)[i] = e4m3_stochastic(mul_rn(x, inverse), bits);
  }
}

constexpr bool has_scales(StateFormat f) { return f != StateFormat::kBFloat16; }

// ---- the momentum step of one element (momentum_math.h with an fp32 buffer) ----
// The Newton–Schulz input is formed from the fp32 momentum of this step: only what is carried to
// the next step is rounded to the state format.
template <typename GradT, bool kL2>
struct QuantizedMomentumElement {
  const GradT* grad;
  const GradT* param;
  float l2_decay;
  MomentumCoefficients coefficients;

  MEGATRON_EOPT_HD MomentumResult operator()(int64_t i, float old_buffer) const {
    const float p = kL2 ? to_float(param[i]) : 0.f;
    return momentum_element<GradT, float, kL2>(to_float(grad[i]), p, l2_decay, old_buffer, coefficients);
  }
};

// ---- AdaMuon's second moment of one element ----
// v <- lerp(v, o^2, 1 - beta2), o <- o / (sqrt(v) + eps), as adamuon_normalize (fp32 state). The
// stored quantity is v for bf16 and sqrt(v) for e4m3: v spans far more binades than a block of
// e4m3 holds, its square root half as many.
template <StateFormat F>
MEGATRON_EOPT_HD float moment2_stored(float v) {
  return F == StateFormat::kBFloat16 ? v : sqrtf(v);
}
template <StateFormat F>
MEGATRON_EOPT_HD float moment2_from_stored(float s) {
  return F == StateFormat::kBFloat16 ? s : mul_rn(s, s);
}

// Calls f(TypeTag<Grad>, TypeTag<Ns>, bool_constant<l2>, integral_constant<StateFormat>).
template <typename F>
void dispatch_quantized_momentum(const QuantizedMomentumArgs& a, F&& f) {
  visit_param_type(a.grad_type, [&](auto grad_tag) {
    visit_ns_type(a.ns_type, [&](auto ns_tag) {
      auto with_format = [&](auto l2) {
        switch (a.format) {
          case StateFormat::kBFloat16:
            return f(grad_tag, ns_tag, l2, std::integral_constant<StateFormat, StateFormat::kBFloat16>{});
          case StateFormat::kInt8:
            return f(grad_tag, ns_tag, l2, std::integral_constant<StateFormat, StateFormat::kInt8>{});
          case StateFormat::kFloat8E4M3Squared:
            return f(grad_tag, ns_tag, l2, std::integral_constant<StateFormat, StateFormat::kFloat8E4M3Squared>{});
          case StateFormat::kFloat8E4M3: break;  // the second moment's format
        }
        throw std::invalid_argument("foreach_momentum_quantized_: unknown state format");
      };
      if (a.l2) {
        with_format(std::true_type{});
      } else {
        with_format(std::false_type{});
      }
    });
  });
}

// Calls f(integral_constant<StateFormat>) for the second moment's formats.
template <typename F>
void dispatch_quantized_moment2(const QuantizedMoment2Args& a, F&& f) {
  if (a.format == StateFormat::kBFloat16) {
    f(std::integral_constant<StateFormat, StateFormat::kBFloat16>{});
  } else if (a.format == StateFormat::kFloat8E4M3) {
    f(std::integral_constant<StateFormat, StateFormat::kFloat8E4M3>{});
  } else {
    throw std::invalid_argument("adamuon_normalize_quantized_: the second moment is kept in bf16 or fp8");
  }
}

}  // namespace megatron_eopt
