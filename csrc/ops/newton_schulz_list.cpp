// List form of Newton–Schulz: matrices of equal shape are stacked and orthogonalized as one batch
// through the single-tensor op, outputs come back in input order (each its own tensor). Same code
// for every backend.
#include <stdexcept>
#include <string>

#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/shape_groups.h"
#include "ops/newton_schulz_args.h"
#include "ops/newton_schulz_op.h"

namespace megatron_eopt {
namespace {

std::vector<Tensor> newton_schulz_list(const TensorList& xs, const std::vector<double>& coefficients, int64_t steps,
                                       bool repeat_last, double eps, std::optional<bool> transpose,
                                       const std::string& precision, const std::string& algorithm,
                                       const std::string& eps_mode, double norm_divisor, bool row_equilibration,
                                       bool frobenius_renorm, const std::string& products) {
  try {
    parse_ns_algorithm(algorithm);
  } catch (const std::invalid_argument& e) {
    MEGATRON_EOPT_CHECK_VALUE(false, "newton_schulz_list: ", e.what());
  }
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) {
    MEGATRON_EOPT_CHECK_TYPE(xs[i].scalar_type() == kFloat, "newton_schulz_list: xs[", i, "] must be float32, got ",
                             xs[i].scalar_type());
    MEGATRON_EOPT_CHECK_VALUE(xs[i].dim() == 2, "newton_schulz_list: xs[", i, "] must be 2-D, got ", xs[i].dim(), "-D");
    MEGATRON_EOPT_CHECK_VALUE(xs[i].device() == xs[0].device(), "newton_schulz_list: xs[", i, "] is on ",
                              xs[i].device(), " but xs[0] is on ", xs[0].device());
    shapes.push_back(aten::sizes_of(xs[i]));
  }
  // The hyper-parameters are checked here, before the nested newton_schulz calls: torch 2.11 and
  // 2.12 pass an error raised inside a nested dispatcher call on without its message.
  if (!xs.empty()) {
    parse_ns_options(xs[0], coefficients, steps, repeat_last, eps, transpose, precision, algorithm, eps_mode,
                     norm_divisor, row_equilibration, frobenius_renorm, products);
  }
  std::vector<Tensor> out(xs.size());
  for (const auto& group : group_by_shape(shapes)) {
    std::vector<Tensor> members;
    members.reserve(group.size());
    for (std::size_t i : group) members.push_back(xs[i]);
    const Tensor result = call_newton_schulz(aten::stack(members, 0), coefficients, steps, repeat_last, eps, transpose,
                                             precision, algorithm, eps_mode, norm_divisor, row_equilibration,
                                             frobenius_renorm, products);
    // Outputs of a custom op may not alias each other, so a batch is split into copies; the
    // optimizers avoid this pass by keeping their inputs stacked and calling newton_schulz directly.
    if (group.size() == 1) {
      out[group[0]] = aten::select(result, 0, 0);
    } else {
      for (std::size_t j = 0; j < group.size(); ++j)
        out[group[j]] = aten::clone(aten::select(result, 0, static_cast<int64_t>(j)));
    }
  }
  return out;
}

}  // namespace

// Composed of newton_schulz calls through the dispatcher: one kernel serves every backend that
// implements newton_schulz (the CUDA one lives in the separately loaded CUDA library).
STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CompositeExplicitAutograd, m) {
  m.impl("newton_schulz_list", TORCH_BOX(&newton_schulz_list));
}

}  // namespace megatron_eopt
