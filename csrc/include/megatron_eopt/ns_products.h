// How one Newton–Schulz call computes its products with a symmetric result (X X^T, G G and the
// Gram iteration's s x s products): the ops' `products` argument. Torch-free.
#pragma once

#include <stdexcept>
#include <string>

namespace megatron_eopt {

enum class NsProducts {
  kAuto,       // as the device's measurement, or its process-wide setting, decides
  kSymmetric,  // the symmetric kernel, or lower block panels and a mirror, wherever the side allows them
  kFull        // one full GEMM each
};

inline NsProducts parse_ns_products(const std::string& name) {
  if (name == "auto") return NsProducts::kAuto;
  if (name == "symmetric") return NsProducts::kSymmetric;
  if (name == "full") return NsProducts::kFull;
  throw std::invalid_argument("products must be one of auto, symmetric, full; got '" + name + "'");
}

}  // namespace megatron_eopt
