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

// On the CPU, "medium" iterates in fp32 when the Gram side (the short side) is below this: a
// matrix of rank 1 or 2, where each step's bf16 rounding of the s x s polynomial P lands on its one
// or two singular values whole. In bf16 a rank-1 input ends up to 3.5% from float64 (5x a bf16
// re-expression of the iteration, past docs/design.md §9's 2e-2), a rank-2 one 3.3%; from rank 3 on the bf16
// iteration is within its re-expression's error. The work of such a matrix is negligible.
constexpr int64_t kCpuMediumMinSide = 3;

inline NsPrecision cpu_iteration_precision(NsPrecision requested, int64_t gram_side) {
  return requested == NsPrecision::kMedium && gram_side < kCpuMediumMinSide ? NsPrecision::kHighest : requested;
}

inline std::size_t ns_element_bytes(NsPrecision p) { return p == NsPrecision::kMedium ? 2 : 4; }

}  // namespace megatron_eopt
