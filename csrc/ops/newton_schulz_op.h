// megatron_eopt::newton_schulz called through the dispatcher, so the composite ops (list, split)
// reach whichever backend implements it, the CUDA one living in the separately loaded library.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "ops/aten_ops.h"

namespace megatron_eopt {

inline Tensor call_newton_schulz(const Tensor& x, const std::vector<double>& coefficients, int64_t steps,
                                 bool repeat_last, double eps, std::optional<bool> transpose,
                                 const std::string& precision, const std::string& algorithm,
                                 const std::string& eps_mode, double norm_divisor, bool row_equilibration,
                                 bool frobenius_renorm, const std::string& products) {
  return aten::detail::call("megatron_eopt::newton_schulz", "", x, coefficients, steps, repeat_last, eps, transpose,
                            precision, algorithm, eps_mode, norm_divisor, row_equilibration, frobenius_renorm,
                            products);
}

}  // namespace megatron_eopt
