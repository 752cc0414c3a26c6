// Per-element math of the foreach momentum and update ops (DESIGN §4.3), shared verbatim by the
// CUDA functors and the CPU loops so both backends compute the same values. Everything is fp32;
// values are rounded to their storage type exactly where the reference (Emerging-Optimizers'
// per-parameter torch ops) stores them, and products that torch's kernels fuse are fused here
// with explicit fmaf, so results do not depend on the compiler's contraction choices.
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>
#include <string_view>

#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

enum class WeightDecayMethod : int { kDecoupled, kIndependent, kL2, kPalm };

inline WeightDecayMethod parse_weight_decay_method(std::string_view name) {
  if (name == "decoupled") return WeightDecayMethod::kDecoupled;
  if (name == "independent") return WeightDecayMethod::kIndependent;
  if (name == "l2") return WeightDecayMethod::kL2;
  if (name == "palm") return WeightDecayMethod::kPalm;
  throw std::invalid_argument("unknown weight_decay_method '" + std::string(name) +
                              "', expected one of: decoupled, independent, l2, palm");
}

// torch.lerp(start, end, weight) for a scalar weight: the two formulas torch switches between at
// |weight| = 0.5, each as the single fma torch's CPU (vectorized) and CUDA kernels evaluate.
// Every operand is computed unconditionally and only selected (no branch, nothing for the
// compiler to speculate), so CPU loops over it vectorize.
MEGATRON_EOPT_HD float torch_lerp(float start, float end, float weight) {
  const bool small = fabsf(weight) < 0.5f;
  const float weight_minus_one = weight - 1.f;
  const float coefficient = small ? weight : weight_minus_one;
  const float base = small ? start : end;
  return fmaf(coefficient, end - start, base);
}

struct MomentumCoefficients {
  float ema_weight;       // 1 - momentum: M.lerp_(g, 1 - momentum)
  float nesterov_weight;  // momentum: g.lerp(M, momentum)
  bool nesterov;
};

struct MomentumResult {
  float buffer;    // new momentum buffer value, already rounded to the buffer's storage type
  float ns_input;  // Newton–Schulz input (caller stores it in its own type)
};

// One element of the momentum step. g and p are the gradient and parameter (p is read only for
// l2 weight decay, with `l2_decay` = weight_decay), m the current buffer value.
//   l2:       g <- g + wd * p            (stored in the gradient's type, as the reference's grad.add_)
//   EMA:      M <- lerp(M, g, 1 - mu)    (stored in the buffer's type)
//   nesterov: G = lerp(g, M, mu)         (in the promoted type of g and M), else G = M
template <typename GradT, typename BufT, bool kL2>
MEGATRON_EOPT_HD MomentumResult momentum_element(float g, float p, float l2_decay, float m,
                                                 const MomentumCoefficients& c) {
  if constexpr (kL2) g = round_to<GradT>(fmaf(p, l2_decay, g));
  const float buffer = round_to<BufT>(torch_lerp(m, g, c.ema_weight));
  using NesterovT = typename Wider<GradT, BufT>::type;
  const float nesterov = round_to<NesterovT>(torch_lerp(g, buffer, c.nesterov_weight));
  return {buffer, c.nesterov ? nesterov : buffer};  // a select, not a branch: keeps loops vectorizable
}

// The factor f of p <- p - f * p for a weight-decay method; l2 decays the gradient instead (0).
// Formed in double and rounded once, like the reference's Python-float alpha.
MEGATRON_EOPT_HD float weight_decay_factor(WeightDecayMethod method, float lr, float weight_decay) {
  const double l = lr;
  const double w = weight_decay;
  switch (method) {
    case WeightDecayMethod::kDecoupled:
      return static_cast<float>(w * l);
    case WeightDecayMethod::kIndependent:
      return weight_decay;
    case WeightDecayMethod::kPalm:
      return static_cast<float>(w * l * l);
    case WeightDecayMethod::kL2:
    default:
      return 0.f;
  }
}

// One element of the parameter update: p.add_(p, alpha=-f) (stored in the parameter's type),
// then p.add_(U * scale, alpha=-lr).
template <typename ParamT>
MEGATRON_EOPT_HD float update_element(float p, float u, float scale, float decay, float lr) {
  const float decayed = round_to<ParamT>(fmaf(p, -decay, p));
  return fmaf(u * scale, -lr, decayed);
}

}  // namespace megatron_eopt
