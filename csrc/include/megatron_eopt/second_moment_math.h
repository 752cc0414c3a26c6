// Second-moment normalization of the raw Newton–Schulz output O (docs/design.md §4.7): the per-element /
// per-slice / per-matrix math of AdaMuon, NorMuon and NAMO, shared by the CUDA kernels, the CPU
// kernels and the GoogleTest suite. The reductions (slice sums, Frobenius norms) are done by the
// callers; these functions get their results. Operation order follows Emerging-Optimizers 0.3.0
// (AdaptiveMuon._apply_moment2_normalization) so fp32 results match it to rounding.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "megatron_eopt/host_device.h"
#include "megatron_eopt/step_scalar.h"
#include "megatron_eopt/torch_lerp.h"

namespace megatron_eopt {

enum class Moment2Method { kAdamuon, kNormuon, kNamo };

// Every EMA below, v <- beta2 v + (1 - beta2) target, is v.lerp_(target, 1 - beta2) in the
// reference: torch_lerp(v, target, weight = 1 - beta2), bit-exact with torch's kernels.

// The per-step values every normalization reads (0-dim tensors on the op's device).
struct Moment2Scalars {
  StepScalar beta2;
  StepScalar eps;
  StepScalar grad_scale;  // NAMO only, optional: its gradients arrive multiplied by it
  StepScalar found_inf;   // optional: non-zero leaves updates and state untouched
};

// fp32 values of one step: the lerp weight float(1 - beta2), rounded once from fp64 as the
// reference's Python float, and eps.
struct Moment2Step {
  float weight;
  float eps;
};

MEGATRON_EOPT_HD Moment2Step moment2_step(const Moment2Scalars& s) {
  return {static_cast<float>(1.0 - s.beta2.load()), static_cast<float>(s.eps.load())};
}

// mul_rn (host_device.h): ptxas would fuse o * o - v into one fma, which torch's separate
// square and lerp kernels do not.

MEGATRON_EOPT_HD float reciprocal_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);
#else
  return 1.0f / std::sqrt(x);
#endif
}

// AdaMuon, one element: v <- lerp(v, o^2, 1 - beta2); returns o / (sqrt(v) + eps).
// No bias correction. o = 0 with v = 0 gives 0 (eps > 0).
MEGATRON_EOPT_HD float adamuon_normalize(float o, float& v, float weight, float eps) {
  v = torch_lerp(v, mul_rn(o, o), weight);
  return o / (sqrtf(v) + eps);
}

// rsqrt(max(v, eps)) of an already updated v (the apply pass recomputes it from the state).
MEGATRON_EOPT_HD float normuon_step_size(float v, float eps) { return reciprocal_sqrt(fmaxf(v, eps)); }

// NorMuon, one slice (a row when rows >= cols, else a column) of `slice_len` elements whose
// squares sum to `slice_sum_sq`: v <- lerp(v, mean(o^2), 1 - beta2); returns the slice's step size
// rsqrt(max(v, eps)). The update is then o * step * normuon_norm_ratio(...).
MEGATRON_EOPT_HD float normuon_slice_step(float& v, float slice_sum_sq, int64_t slice_len, float weight, float eps) {
  v = torch_lerp(v, slice_sum_sq / static_cast<float>(slice_len), weight);
  return normuon_step_size(v, eps);
}

// NorMuon's Frobenius-norm match: ||O||_F / max(||U'||_F, eps) from sum(O^2) and sum(U'^2), U' the
// fp32-rounded O * step (what Emerging-Optimizers 0.4 measures). Zero O gives 0.
MEGATRON_EOPT_HD float normuon_norm_ratio(float sum_sq_o, float sum_sq_scaled, float eps) {
  return sqrtf(sum_sq_o) / fmaxf(sqrtf(sum_sq_scaled), eps);
}

// NAMO, one matrix: v <- lerp(v, ||g||_F^2, 1 - beta2) (scalar state); returns the factor
// ||G~||_F / (sqrt(v) + eps) that multiplies O, where G~ is the Newton–Schulz input. With a
// GradScaler the caller passes ||g||_F^2 of the unscaled gradient (namo_grad_sum_sq).
MEGATRON_EOPT_HD float namo_scale(float& v, float grad_sum_sq, float ns_input_sum_sq, float weight, float eps) {
  v = torch_lerp(v, grad_sum_sq, weight);
  return sqrtf(ns_input_sum_sq) / (sqrtf(v) + eps);
}

// ||g / s||_F^2 from ||g||_F^2 of gradients scaled by s (exact for GradScaler's powers of two).
MEGATRON_EOPT_HD float namo_grad_sum_sq(float scaled_sum_sq, double grad_scale) {
  const float s = static_cast<float>(grad_scale);
  return scaled_sum_sq / (s * s);
}

}  // namespace megatron_eopt
