// Argument checks shared by the CPU and CUDA Newton–Schulz implementations.
#pragma once

#include <optional>
#include <vector>

#include <string>

#include "ops/stable.h"

#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/ns_precision.h"
#include "megatron_eopt/ns_products.h"
#include "megatron_eopt/ns_recipe.h"
#include "megatron_eopt/ns_schedule.h"

namespace megatron_eopt {

struct NsOptions {
  std::vector<NsCoefficients> schedule;
  float eps;
  bool transpose;  // iterate on X^T
  NsPrecision precision;
  NsAlgorithm algorithm;  // as requested: auto, standard or gram
  int64_t batch, rows, cols;  // of the input, 2-D inputs having batch 1
  NsRecipe recipe;  // MuonEq, normalization convention and divisor, Muon+ (ns_recipe.h)
  NsProducts products;  // how the symmetric products run (ns_products.h)
};

// Validates x (fp32, 2-D or 3-D) and the hyper-parameters; every failure names its argument.
NsOptions parse_ns_options(const Tensor& x, const std::vector<double>& coefficients, int64_t steps, bool repeat_last,
                           double eps, std::optional<bool> transpose, const std::string& precision,
                           const std::string& algorithm, const std::string& eps_mode = "clamp",
                           double norm_divisor = 1.0, bool row_equilibration = false, bool frobenius_renorm = false,
                           const std::string& products = "auto");

// One backend's newton_schulz or newton_schulz_ kernel entry: the schema's arguments after `x`
// written once, for every backend and variant, and parsed by parse_ns_options before
// `Body(x, options)` (the backend's out-of-place or in-place body) runs.
template <auto Body>
auto newton_schulz_entry(const Tensor& x, const std::vector<double>& coefficients, int64_t steps, bool repeat_last,
                         double eps, std::optional<bool> transpose, const std::string& precision,
                         const std::string& algorithm, const std::string& eps_mode, double norm_divisor,
                         bool row_equilibration, bool frobenius_renorm, const std::string& products) {
  return Body(x, parse_ns_options(x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm, eps_mode,
                                  norm_divisor, row_equilibration, frobenius_renorm, products));
}

// The algorithm that runs on `device` (auto resolved) and, for Gram, its program.
// `cpu_bf16_speedup`: how many times faster the CPU's "medium" standard iteration runs its products
// than the Gram iteration (the CPU caller passes its product plan's; see gram_flop_weight).
NsAlgorithmChoice resolve_ns_algorithm(const NsOptions& opts, NsDevice device,
                                       double cpu_bf16_speedup = kDefaultCpuBf16Speedup);

}  // namespace megatron_eopt
