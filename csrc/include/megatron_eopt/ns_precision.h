// Compute precision of the Newton–Schulz GEMMs, named as torch.set_float32_matmul_precision.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace megatron_eopt {

enum class NsPrecision {
  kMedium,  // bf16 storage, fp32 accumulation
  kHigh,    // fp32 storage, TF32 tensor-core products
  kHighest  // fp32 throughout
};

inline NsPrecision parse_ns_precision(const std::string& name) {
  if (name == "medium") return NsPrecision::kMedium;
  if (name == "high") return NsPrecision::kHigh;
  if (name == "highest") return NsPrecision::kHighest;
  throw std::invalid_argument("precision must be one of medium, high, highest; got '" + name + "'");
}

// On the CPU, "medium" iterates in fp32 when the Gram side (the short side) is below this. Such a
// matrix has at most a few singular values, and each step's bf16 rounding of the s x s polynomial
// P lands on them whole: a rank-1 input ends up to 2.2% from float64 (5x a bf16 re-expression of
// the iteration, past DESIGN §6's 2e-2). Its work (side^2 x long side) is too small for bf16
// GEMMs to save anything.
constexpr int64_t kCpuMediumMinSide = 32;

inline NsPrecision cpu_iteration_precision(NsPrecision requested, int64_t gram_side) {
  return requested == NsPrecision::kMedium && gram_side < kCpuMediumMinSide ? NsPrecision::kHighest : requested;
}

inline std::size_t ns_element_bytes(NsPrecision p) { return p == NsPrecision::kMedium ? 2 : 4; }

}  // namespace megatron_eopt
