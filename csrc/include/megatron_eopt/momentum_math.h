// Per-element math of the foreach momentum and update ops (docs/design.md §4.6), shared verbatim by the
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
#include "megatron_eopt/torch_lerp.h"

namespace megatron_eopt {

// kCautious: decoupled decay applied only where the update and the parameter agree in sign
// (Chen et al., "Cautious Weight Decay", 2025); like kDecoupled, the gradient is not decayed.
enum class WeightDecayMethod : int { kDecoupled, kIndependent, kL2, kPalm, kCautious };

inline WeightDecayMethod parse_weight_decay_method(std::string_view name) {
  if (name == "decoupled") return WeightDecayMethod::kDecoupled;
  if (name == "independent") return WeightDecayMethod::kIndependent;
  if (name == "l2") return WeightDecayMethod::kL2;
  if (name == "palm") return WeightDecayMethod::kPalm;
  if (name == "cautious") return WeightDecayMethod::kCautious;
  throw std::invalid_argument("unknown weight_decay_method '" + std::string(name) +
                              "', expected one of: decoupled, independent, l2, palm, cautious");
}

struct MomentumCoefficients {
  float ema_weight;       // 1 - momentum: M.lerp_(g, 1 - momentum)
  float nesterov_weight;  // momentum: g.lerp(M, momentum)
  bool nesterov;
  float grad_scale;  // gradients arrive multiplied by it (GradScaler; 1 without one)
};

// The coefficients of one step from the momentum value (fp64, as the reference's Python float:
// the lerp weight is float(1 - momentum), rounded once).
MEGATRON_EOPT_HD MomentumCoefficients momentum_coefficients(double momentum, bool nesterov, double grad_scale) {
  return {static_cast<float>(1.0 - momentum), static_cast<float>(momentum), nesterov, static_cast<float>(grad_scale)};
}

struct MomentumResult {
  float buffer;    // new momentum buffer value, already rounded to the buffer's storage type
  float ns_input;  // Newton–Schulz input (caller stores it in its own type)
};

// One element of the momentum step. g and p are the gradient and parameter (p is read only for
// l2 weight decay, with `l2_decay` = weight_decay), m the current buffer value.
//   unscale:  g <- g / grad_scale        (in fp32, as torch's fused Adam; exact for 1)
//   l2:       g <- g + wd * p            (stored in the gradient's type, as the reference's grad.add_)
//   EMA:      M <- lerp(M, g, 1 - mu)    (stored in the buffer's type)
//   nesterov: G = lerp(g, M, mu)         (in the promoted type of g and M), else G = M
template <typename GradT, typename BufT, bool kL2>
MEGATRON_EOPT_HD MomentumResult momentum_element(float g, float p, float l2_decay, float m,
                                                 const MomentumCoefficients& c) {
  g = g / c.grad_scale;
  if constexpr (kL2) g = round_to<GradT>(fmaf(p, l2_decay, g));
  const float buffer = round_to<BufT>(torch_lerp(m, g, c.ema_weight));
  using NesterovT = typename Wider<GradT, BufT>::type;
  const float nesterov = round_to<NesterovT>(torch_lerp(g, buffer, c.nesterov_weight));
  return {buffer, c.nesterov ? nesterov : buffer};  // a select, not a branch: keeps loops vectorizable
}

// The factor f of p <- p - f * p for a weight-decay method; l2 decays the gradient instead (0).
// Formed in double and rounded once, like the reference's Python-float alpha.
MEGATRON_EOPT_HD float weight_decay_factor(WeightDecayMethod method, double lr, double weight_decay) {
  const double l = lr;
  const double w = weight_decay;
  switch (method) {
    case WeightDecayMethod::kDecoupled:
    case WeightDecayMethod::kCautious: return static_cast<float>(w * l);
    case WeightDecayMethod::kIndependent: return static_cast<float>(w);
    case WeightDecayMethod::kPalm: return static_cast<float>(w * l * l);
    case WeightDecayMethod::kL2:
    default: return 0.f;
  }
}

// The decay step of cautious weight decay: p - f·p where U·p >= 0 (U the update as given, before
// its scale, which is positive), else p; f = lr·wd rounded to the parameter's type. The numerics
// of the PyTorch form p.sub_(p * (U * p >= 0) * f.to(p.dtype)): every product rounded to the
// parameter's type on its own (an inf or NaN p whose mask is off still gives NaN, as p * 0 does).
template <typename ParamT>
MEGATRON_EOPT_HD float cautious_decay_element(float p, float u, float decay) {
  const float keep = (u * p >= 0.f) ? 1.f : 0.f;  // NaN compares false: no decay, as in torch
  const float term = round_to<ParamT>(mul_rn(p * keep, round_to<ParamT>(decay)));
  return round_to<ParamT>(p - term);
}

// One element of the parameter update: p.add_(p, alpha=-f) (stored in the parameter's type), or
// the cautious decay when kCautious, then p.add_(U * scale, alpha=-lr).
template <typename ParamT, bool kCautious = false>
MEGATRON_EOPT_HD float update_element(float p, float u, float scale, float decay, float lr) {
  float decayed;
  if constexpr (kCautious) {
    decayed = cautious_decay_element<ParamT>(p, u, decay);
  } else {
    decayed = round_to<ParamT>(fmaf(p, -decay, p));
  }
  return fmaf(u * scale, -lr, decayed);
}

}  // namespace megatron_eopt
