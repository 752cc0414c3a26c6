// Compute precision of the Newton–Schulz GEMMs, named as torch.set_float32_matmul_precision.
#pragma once

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

inline std::size_t ns_element_bytes(NsPrecision p) { return p == NsPrecision::kMedium ? 2 : 4; }

}  // namespace megatron_eopt
