// Split orthogonalization of a fused projection (DESIGN §4.5): x (rows, n) viewed as
// (num_groups, sum(split_sizes), n) is cut along the middle dimension; each part, the
// (num_groups * size, n) matrix of its rows across the groups, is orthogonalized (parts of equal
// size as one batch through the newton_schulz op), optionally scaled by its own Muon factor, and
// put back in place. A (batch, rows, n) stack of projections of one shape runs the same way with
// the parts of all of them in one newton_schulz call per part size. Same code for every backend.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/stack.h>
#include <torch/library.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/scale.h"
#include "megatron_eopt/split_layout.h"

namespace megatron_eopt {
namespace {

using NsFn = at::Tensor(const at::Tensor&, c10::ArrayRef<double>, int64_t, bool, double, std::optional<bool>,
                        c10::string_view, c10::string_view);

at::Tensor newton_schulz_split(const at::Tensor& x, at::IntArrayRef split_sizes, int64_t num_groups,
                               c10::ArrayRef<double> coefficients, int64_t steps, bool repeat_last, double eps,
                               std::optional<bool> transpose, c10::string_view precision,
                               std::optional<c10::string_view> scale_mode, double extra_scale_factor,
                               c10::string_view algorithm) {
  static const auto ns =
      c10::Dispatcher::singleton().findSchemaOrThrow("megatron_eopt::newton_schulz", "").typed<NsFn>();
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, "newton_schulz_split: x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 || x.dim() == 3, "newton_schulz_split: x must be 2-D (rows, n) or 3-D (batch, rows, n), got ",
                    x.dim(), "-D");
  TORCH_CHECK_VALUE(std::isfinite(extra_scale_factor), "newton_schulz_split: extra_scale_factor must be finite, got ",
                    extra_scale_factor);
  TORCH_CHECK_VALUE(scale_mode.has_value() || extra_scale_factor == 1.0,
                    "newton_schulz_split: extra_scale_factor (", extra_scale_factor,
                    ") applies only with a scale_mode; without one the parts are returned unscaled");
  SplitLayout layout;
  std::optional<ScaleMode> mode;
  try {
    layout = plan_split(x.size(-2), std::vector<int64_t>(split_sizes.begin(), split_sizes.end()), num_groups);
    if (scale_mode.has_value()) mode = parse_scale_mode(std::string(scale_mode->data(), scale_mode->size()));
    parse_ns_algorithm(std::string(algorithm.data(), algorithm.size()));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "newton_schulz_split: ", e.what());
  }

  const int64_t n = x.size(-1);
  const int64_t batch = x.dim() == 3 ? x.size(0) : 1;
  const int64_t groups = num_groups;
  // The Muon factor of a part, from its own (num_groups * size, n) shape; 1 without scale_mode.
  const auto factor = [&](int64_t size) {
    return mode ? muon_scale_factor(groups * size, n, *mode) * extra_scale_factor : 1.0;
  };

  // One part size and one group: the parts are consecutive equal row blocks, a view of x
  // (per-head splits, equal gate/up halves), and the batched result is already in place.
  if (layout.same_size.size() == 1 && groups == 1) {
    const int64_t size = layout.same_size[0].size;
    const int64_t parts = static_cast<int64_t>(layout.same_size[0].parts.size());
    at::Tensor out = ns.call(x.reshape({batch * parts, size, n}), coefficients, steps, repeat_last, eps, transpose,
                             precision, algorithm)
                         .view(x.sizes());
    if (mode) out.mul_(factor(size));
    return out;
  }

  const at::Tensor grouped = x.reshape({batch, groups, layout.group_rows, n});
  at::Tensor out = at::empty(x.sizes(), x.options());
  const at::Tensor out_grouped = out.view({batch, groups, layout.group_rows, n});
  for (const SplitGroup& same : layout.same_size) {
    std::vector<at::Tensor> members;
    members.reserve(same.parts.size());
    for (std::size_t k : same.parts) members.push_back(grouped.narrow(2, layout.offsets[k], same.size));
    const int64_t count = static_cast<int64_t>(members.size());
    // (batch, count, groups, size, n) stacked contiguous, so each part of each matrix is one
    // (groups * size, n) matrix of a single batched call.
    const at::Tensor result =
        ns.call(at::stack(members, 1).view({batch * count, groups * same.size, n}), coefficients, steps, repeat_last,
                eps, transpose, precision, algorithm)
            .view({batch, count, groups, same.size, n});
    for (int64_t j = 0; j < count; ++j) {
      at::Tensor dest = out_grouped.narrow(2, layout.offsets[same.parts[j]], same.size);
      const at::Tensor src = result.select(1, j);
      if (mode) {
        at::mul_out(dest, src, factor(same.size));
      } else {
        dest.copy_(src);
      }
    }
  }
  return out;
}

}  // namespace

// Composed of newton_schulz calls through the dispatcher: one kernel serves every backend that
// implements newton_schulz (the CUDA one lives in the separately loaded CUDA library).
TORCH_LIBRARY_IMPL(megatron_eopt, CompositeExplicitAutograd, m) { m.impl("newton_schulz_split", &newton_schulz_split); }

}  // namespace megatron_eopt
