// The 2026 recipe around the Newton–Schulz iteration, folded into the op's first and last passes
// (docs/design.md §4.10): MuonEq row equilibration (arXiv 2603.28254), the two normalization conventions and a
// normalization divisor s >= 1 (Polar Express's safety factor, arXiv 2505.16932), and Muon+
// Frobenius renormalization of the result (arXiv 2602.21545). Torch-free: shared by the CPU
// kernels, the CUDA kernels and the GoogleTest suite.
//
// The input pass of the iteration becomes X[i, :] <- x[i, :] * row_scale_i with
//   without MuonEq:  row_scale_i = 1 / denominator(||x||_F)
//   with MuonEq:     f_i = (||x||_F / sqrt(m)) / max(||x_i||, 1e-6),
//                    row_scale_i = f_i / denominator(||f . x||_F),  ||f . x||_F^2 = sum_i (f_i ||x_i||)^2
// where denominator(v) is max(v, eps) * s ("clamp") or v * s + eps ("add"). The row norms come from
// the same read of x that gives ||x||_F, so MuonEq adds no pass over the matrix. Muon+ multiplies
// the result by sqrt(min(m, n)) / max(||O||_F, 1e-6) in the pass that writes it as fp32.
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "megatron_eopt/host_device.h"

namespace megatron_eopt {

enum class NsEpsMode { kClamp, kAdd };

constexpr float kRowNormFloor = 1e-6f;  // MuonEq's floor of a row norm
constexpr float kRenormFloor = 1e-6f;   // Muon+'s floor of the result's Frobenius norm

inline NsEpsMode parse_ns_eps_mode(const std::string& name) {
  if (name == "clamp") return NsEpsMode::kClamp;
  if (name == "add") return NsEpsMode::kAdd;
  throw std::invalid_argument("eps_mode must be one of clamp, add; got '" + name + "'");
}

struct NsRecipe {
  NsEpsMode eps_mode = NsEpsMode::kClamp;
  float norm_divisor = 1.f;  // s >= 1
  bool row_equilibration = false;
  bool frobenius_renorm = false;

  // Whether the input pass differs from the plain x / max(||x||_F, eps).
  bool changes_input() const { return eps_mode != NsEpsMode::kClamp || norm_divisor != 1.f || row_equilibration; }
  bool is_default() const { return !changes_input() && !frobenius_renorm; }
};

// Checks the recipe's scalars; throws std::invalid_argument naming the argument.
inline NsRecipe make_ns_recipe(const std::string& eps_mode, double norm_divisor, bool row_equilibration,
                               bool frobenius_renorm) {
  NsRecipe r;
  r.eps_mode = parse_ns_eps_mode(eps_mode);
  const float s = static_cast<float>(norm_divisor);
  if (!(std::isfinite(s) && s >= 1.f)) {
    throw std::invalid_argument("norm_divisor must be finite and at least 1, got " + std::to_string(norm_divisor));
  }
  r.norm_divisor = s;
  r.row_equilibration = row_equilibration;
  r.frobenius_renorm = frobenius_renorm;
  return r;
}

// The normalization's denominator for a Frobenius norm `norm`: max(norm, eps) * s ("clamp", NaN
// stays NaN) or norm * s + eps ("add"). With clamp and s = 1 it is max(norm, eps) exactly.
MEGATRON_EOPT_HD float ns_denominator(float norm, float eps, float divisor, NsEpsMode mode) {
  if (mode == NsEpsMode::kAdd) return mul_rn(norm, divisor) + eps;
  const float clamped = norm < eps ? eps : norm;
  return mul_rn(clamped, divisor);
}

// MuonEq's factor of a row of norm `row_norm` in a matrix of Frobenius norm `frob` with `rows` rows:
// the root-mean-square row norm over the row's own norm (floored at 1e-6).
MEGATRON_EOPT_HD float muoneq_row_factor(float row_norm, float frob, int64_t rows) {
  const float target = frob / sqrtf(static_cast<float>(rows));
  const float floor_norm = row_norm < kRowNormFloor ? kRowNormFloor : row_norm;
  return target / floor_norm;
}

// Muon+'s factor of a result with Frobenius norm `norm`: sqrt(min(m, n)) / max(norm, 1e-6).
MEGATRON_EOPT_HD float muon_plus_factor(float norm, int64_t rows, int64_t cols) {
  const float target = sqrtf(static_cast<float>(rows < cols ? rows : cols));
  return target / (norm < kRenormFloor ? kRenormFloor : norm);
}

// The per-row scales of one matrix from its rows' sums of squares (double accumulation), in place:
// on entry row_scale[i] = ||x_i||^2, on return the multiplier of row i (MuonEq's factor over the
// denominator). Without MuonEq every row gets 1 / denominator(||x||_F). Returns the denominator.
// `rows` >= 1. Used by the CPU pass; the CUDA kernel runs the same formulas with one block per
// matrix.
template <typename Acc>
float ns_row_scales(Acc* row_scale, int64_t rows, float eps, const NsRecipe& recipe) {
  double total = 0.0;
  for (int64_t i = 0; i < rows; ++i) total += static_cast<double>(row_scale[i]);
  const float frob = static_cast<float>(std::sqrt(total));
  if (!recipe.row_equilibration) {
    const float denom = ns_denominator(frob, eps, recipe.norm_divisor, recipe.eps_mode);
    for (int64_t i = 0; i < rows; ++i) row_scale[i] = static_cast<Acc>(1.f / denom);
    return denom;
  }
  double equilibrated = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const float row_norm = static_cast<float>(std::sqrt(static_cast<double>(row_scale[i])));
    const float f = muoneq_row_factor(row_norm, frob, rows);
    const double scaled = static_cast<double>(f) * row_norm;
    equilibrated += scaled * scaled;
    row_scale[i] = static_cast<Acc>(f);
  }
  const float denom = ns_denominator(static_cast<float>(std::sqrt(equilibrated)), eps, recipe.norm_divisor,
                                     recipe.eps_mode);
  for (int64_t i = 0; i < rows; ++i) row_scale[i] = static_cast<Acc>(static_cast<float>(row_scale[i]) / denom);
  return denom;
}

}  // namespace megatron_eopt
