// Which Newton–Schulz algorithm runs: the standard iteration (docs/design.md §4.1) or the Gram iteration
// (ns_gram_plan.h), and how "auto" chooses between them. Torch-free (GoogleTest checks the rules).
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron_eopt/ns_gram_plan.h"
#include "megatron_eopt/ns_precision.h"
#include "megatron_eopt/ns_schedule.h"

namespace megatron_eopt {

enum class NsAlgorithm { kAuto, kStandard, kGram };

inline NsAlgorithm parse_ns_algorithm(const std::string& name) {
  if (name == "auto") return NsAlgorithm::kAuto;
  if (name == "standard") return NsAlgorithm::kStandard;
  if (name == "gram") return NsAlgorithm::kGram;
  throw std::invalid_argument("algorithm must be one of auto, standard, gram; got '" + name + "'");
}

enum class NsDevice { kCpu, kCuda };

// How the Gram products are rounded on a device (see GramArithmetic): only CUDA has TF32, so
// "high" on a CPU runs in fp32.
inline GramArithmetic gram_arithmetic(NsPrecision precision, NsDevice device) {
  if (precision == NsPrecision::kMedium) return GramArithmetic::kBf16W;
  if (precision == NsPrecision::kHigh && device == NsDevice::kCuda) return GramArithmetic::kTf32;
  return GramArithmetic::kFp32;
}

// Products with a symmetric result are computed as nb x nb blocks of which only the lower
// nb (nb + 1) / 2 are multiplied (the rest mirrored), one GEMM per column panel: on the CPU, panels
// of at least 256 columns, at most 8 per side (thinner panels lose more BLAS efficiency than they
// save; measured in benchmarks/RESULTS.md, "The figures behind the built-in rules"). CUDA runs full cuBLASLt GEMMs (cuBLASLt has no
// symmetric product; blocks would under-fill the GPU). Products of the form X X^T (both
// iterations' Gram matrix, G G and R R) bypass the panels on a CPU with AVX-512 (cpu/syrk_cpu.h
// multiplies only the upper triangle's 8 x 32 tiles, about half of the product); the models below
// keep the panels' fraction for every symmetric product: both iterations gained from the kernel,
// and the rule below still picks the faster one or one within 1% (see NsAutoRule).
inline int64_t ns_symmetric_blocks(int64_t side, NsDevice device) {
  if (device == NsDevice::kCuda) return 1;
  const int64_t blocks = side / 256;
  return blocks < 1 ? 1 : (blocks > 8 ? 8 : blocks);
}

// Fraction of a symmetric product's FLOPs that is computed with `blocks` blocks per side.
inline double ns_symmetric_fraction(int64_t blocks) {
  return static_cast<double>(blocks + 1) / (2.0 * static_cast<double>(blocks));
}

// Relative cost of one FLOP of the Gram iteration's s x s products against one of the products
// with the long side. On CUDA with "medium", W is bf16 (tensor cores) but R and Q stay fp32 with
// fp32 products (TF32 there lets the recursion diverge for some schedules, e.g. cans), which run
// about 15x slower on Hopper (benchmarks/RESULTS.md); elsewhere all products share a type.
inline double gram_square_flop_weight(NsPrecision precision, NsDevice device) {
  return precision == NsPrecision::kMedium && device == NsDevice::kCuda ? 15.0 : 1.0;
}

// Relative cost of one FLOP of the Gram iteration against one of the standard iteration's. On a
// CPU with "medium" the standard iteration may run ATen's bf16 GEMMs while the Gram iteration keeps
// fp32 products of bf16 values (it needs R with an fp32 result, which those GEMMs cannot write):
// `cpu_bf16_speedup` is how many times faster the standard iteration's products are there, as
// measured on the running CPU (cpu/cpu_product_plan.h; 1 where "medium" runs fp32 GEMMs of bf16
// values). The default, 2.5, is the ratio an AVX512-BF16 CPU measured (benchmarks/RESULTS.md).
// Elsewhere both iterations run the same arithmetic.
constexpr double kDefaultCpuBf16Speedup = 2.5;

inline double gram_flop_weight(NsPrecision precision, NsDevice device,
                               double cpu_bf16_speedup = kDefaultCpuBf16Speedup) {
  return precision == NsPrecision::kMedium && device == NsDevice::kCpu ? std::max(1.0, cpu_bf16_speedup) : 1.0;
}

// When "auto" takes the Gram iteration: its modelled cost (FLOPs weighted as above, symmetric
// products at the fraction the device computes) at most 1/min_speedup of the standard iteration's,
// and a Gram side large enough for the products to be compute-bound.
// CPU: from `python benchmarks/ns_algorithms.py` (figures in benchmarks/RESULTS.md, "The figures
// behind the built-in rules"): Gram is as fast or faster wherever the rule picks it and slower
// wherever the model says 1.0 or less; under s = 128 its extra small products and calls cost more
// than the model says.
// CUDA: not measured yet; set from the FLOP model with a margin for the extra launches (up to four
// s x s products per step instead of one) until a GPU run calibrates it.
struct NsAutoRule {
  double min_speedup;
  int64_t min_gram_side;
};

inline NsAutoRule ns_auto_rule(NsDevice device) {
  return device == NsDevice::kCpu ? NsAutoRule{1.1, 128} : NsAutoRule{1.25, 512};
}

// Modelled time ratio standard / Gram of one call; above 1 the Gram iteration does less work.
inline double gram_speedup_model(const GramProgram& program, std::size_t steps, int64_t m, int64_t n, bool transpose,
                                 NsPrecision precision, NsDevice device,
                                 double cpu_bf16_speedup = kDefaultCpuBf16Speedup) {
  const double sym = ns_symmetric_fraction(ns_symmetric_blocks(program.gram_side, device));
  const NsFlops g = gram_program_flops(program);
  const NsFlops st = standard_flops(m, n, transpose, steps);
  const double standard_cost = sym * st.long_symmetric + st.long_general + sym * st.square;
  const double gram_cost = gram_flop_weight(precision, device, cpu_bf16_speedup) *
                           (sym * g.long_symmetric + g.long_general +
                            gram_square_flop_weight(precision, device) * sym * g.square);
  return gram_cost > 0 ? standard_cost / gram_cost : 0.0;
}

// The largest magnitude the schedule can carry a singular value of the normalized input to: step
// by step, the maximum of |a s + b s^3 + c s^5| over s in [0, bound of the previous step] (starting
// from [0, 1]), sampled at 512 points per step. Orthogonalizing schedules stay below 2 (simple
// 1.20, quintic 1.27, cubic5 1.30, polar_express and cans 1.99 over ten steps); a schedule that does not (e.g. the custom
// (3, 5, 7), (11, 13, 17) of Emerging-Optimizers' tests: 15, then about 1.3e7) amplifies the Gram
// iteration's rounding of R with its singular values, beyond what its restarts were validated for.
inline double ns_schedule_peak(const std::vector<NsCoefficients>& schedule) {
  constexpr int kSamples = 512;
  double bound = 1.0;
  double peak = 1.0;
  for (const NsCoefficients& row : schedule) {
    double top = 0.0;
    for (int i = 0; i <= kSamples; ++i) {
      const double s = bound * i / kSamples;
      const double s2 = s * s;
      const double value = s * (row.a + s2 * (row.b + s2 * row.c));
      top = std::max(top, value < 0 ? -value : value);
    }
    bound = top;
    peak = std::max(peak, top);
  }
  return peak;
}

// "auto" keeps the standard iteration for a schedule whose peak exceeds this (the Gram iteration
// was validated on orthogonalizing schedules only; "gram" asked for explicitly still runs).
constexpr double kGramMaxSchedulePeak = 4.0;

// Everything an executor needs: the algorithm that runs and, for Gram, its program.
struct NsAlgorithmChoice {
  NsAlgorithm algorithm;  // kStandard or kGram, never kAuto
  GramProgram program;    // valid when algorithm == kGram
};

// `cpu_bf16_speedup`: on a CPU under "medium", how many times faster the standard iteration's
// products are than the Gram iteration's (gram_flop_weight). The CPU keeps W's bf16 values in fp32
// buffers, so its programs may hold W in the output (make_gram_program's w_in_out).
inline NsAlgorithmChoice choose_ns_algorithm(NsAlgorithm requested, int64_t m, int64_t n, bool transpose,
                                             const std::vector<NsCoefficients>& schedule, NsPrecision precision,
                                             NsDevice device, double cpu_bf16_speedup = kDefaultCpuBf16Speedup) {
  NsAlgorithmChoice choice{NsAlgorithm::kStandard, {}};
  if (requested == NsAlgorithm::kStandard) return choice;
  if (requested == NsAlgorithm::kAuto && ns_schedule_peak(schedule) > kGramMaxSchedulePeak) return choice;
  const std::vector<bool> restart = gram_restarts(schedule, gram_arithmetic(precision, device));
  const bool x_bf16 = precision == NsPrecision::kMedium;
  GramProgram program = make_gram_program(m, n, transpose, schedule, restart, x_bf16,
                                          !x_bf16 || device == NsDevice::kCpu);
  if (requested == NsAlgorithm::kAuto) {
    const NsAutoRule rule = ns_auto_rule(device);
    const int64_t side = transpose ? n : m;
    const double speedup = gram_speedup_model(program, schedule.size(), m, n, transpose, precision, device,
                                              cpu_bf16_speedup);
    if (side < rule.min_gram_side || speedup < rule.min_speedup) return choice;
  }
  choice.algorithm = NsAlgorithm::kGram;
  choice.program = std::move(program);
  return choice;
}

// Whether the CUDA executors may write the result over their input (newton_schulz_): they read the
// input in their first pass only, the normalization, so the result may take its memory unless that
// pass itself writes there, a kernel reading and writing one array through restrict pointers.
// Standard: the normalized input goes to iterate[steps % 2], which is the output (fp32 iterates)
// when the step count is even; under "medium" the iterates are bf16 scratch and the output is
// written last. Gram: the program's first W is the output buffer or a scratch one.
// (The CPU executors normalize with explicit per-element loops, in place or not.)
inline bool cuda_result_may_overwrite_input(const NsAlgorithmChoice& choice, NsPrecision precision, std::size_t steps) {
  if (choice.algorithm == NsAlgorithm::kGram) return choice.program.x_first != GramBuf::kOut;
  return precision == NsPrecision::kMedium || steps % 2 == 1;
}

}  // namespace megatron_eopt
