// List form of Newton–Schulz: matrices of equal shape are stacked and orthogonalized as one batch
// through the single-tensor op, outputs come back in input order (each its own tensor). Same code
// for every backend.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/clone.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>

#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/shape_groups.h"

namespace megatron_eopt {
namespace {

using NsFn = at::Tensor(const at::Tensor&, c10::ArrayRef<double>, int64_t, bool, double, std::optional<bool>,
                        c10::string_view, c10::string_view);

std::vector<at::Tensor> newton_schulz_list(at::TensorList xs, c10::ArrayRef<double> coefficients, int64_t steps,
                                           bool repeat_last, double eps, std::optional<bool> transpose,
                                           c10::string_view precision, c10::string_view algorithm) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("megatron_eopt::newton_schulz", "").typed<NsFn>();
  try {
    parse_ns_algorithm(std::string(algorithm.data(), algorithm.size()));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "newton_schulz_list: ", e.what());
  }
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(xs.size());
  for (std::size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK_VALUE(xs[i].dim() == 2, "newton_schulz_list: xs[", i, "] must be 2-D, got ", xs[i].dim(), "-D");
    TORCH_CHECK_VALUE(xs[i].device() == xs[0].device(), "newton_schulz_list: xs[", i, "] is on ",
                      xs[i].device(), " but xs[0] is on ", xs[0].device());
    shapes.emplace_back(xs[i].sizes().begin(), xs[i].sizes().end());
  }
  std::vector<at::Tensor> out(xs.size());
  for (const auto& group : group_by_shape(shapes)) {
    std::vector<at::Tensor> members;
    members.reserve(group.size());
    for (std::size_t i : group) members.push_back(xs[i]);
    const at::Tensor result =
        op.call(at::stack(members), coefficients, steps, repeat_last, eps, transpose, precision, algorithm);
    // Outputs of a custom op may not alias each other, so a batch is split into copies; the
    // optimizers avoid this pass by keeping their inputs stacked and calling newton_schulz directly.
    if (group.size() == 1) {
      out[group[0]] = result.select(0, 0);
    } else {
      for (std::size_t j = 0; j < group.size(); ++j) out[group[j]] = result.select(0, static_cast<int64_t>(j)).clone();
    }
  }
  return out;
}

}  // namespace

// Composed of newton_schulz calls through the dispatcher: one kernel serves every backend that
// implements newton_schulz (the CUDA one lives in the separately loaded CUDA library).
TORCH_LIBRARY_IMPL(megatron_eopt, CompositeExplicitAutograd, m) { m.impl("newton_schulz_list", &newton_schulz_list); }

}  // namespace megatron_eopt
