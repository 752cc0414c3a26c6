// Split orthogonalization of a fused projection (docs/design.md §4.8): x (rows, n) viewed as
// (num_groups, sum(split_sizes), n) is cut along the middle dimension; each part, the
// (num_groups * size, n) matrix of its rows across the groups, is orthogonalized (parts of equal
// size as one batch through the newton_schulz op), optionally scaled by its own Muon factor, and
// put back in place. A (batch, rows, n) stack of projections of one shape runs the same way with
// the parts of all of them in one newton_schulz call per part size. Same code for every backend.
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/scale.h"
#include "megatron_eopt/split_layout.h"
#include "ops/newton_schulz_args.h"
#include "ops/newton_schulz_op.h"

namespace megatron_eopt {
namespace {

Tensor newton_schulz_split(const Tensor& x, const std::vector<int64_t>& split_sizes, int64_t num_groups,
                           const std::vector<double>& coefficients, int64_t steps, bool repeat_last, double eps,
                           std::optional<bool> transpose, const std::string& precision,
                           const std::optional<std::string>& scale_mode, double extra_scale_factor,
                           const std::string& algorithm, const std::string& eps_mode, double norm_divisor,
                           bool row_equilibration, bool frobenius_renorm, const std::string& products) {
  MEGATRON_EOPT_CHECK_TYPE(x.scalar_type() == kFloat, "newton_schulz_split: x must be float32, got ", x.scalar_type());
  MEGATRON_EOPT_CHECK_VALUE(x.dim() == 2 || x.dim() == 3,
                            "newton_schulz_split: x must be 2-D (rows, n) or 3-D (batch, rows, n), got ", x.dim(),
                            "-D");
  MEGATRON_EOPT_CHECK_VALUE(std::isfinite(extra_scale_factor),
                            "newton_schulz_split: extra_scale_factor must be finite, got ", extra_scale_factor);
  MEGATRON_EOPT_CHECK_VALUE(scale_mode.has_value() || extra_scale_factor == 1.0,
                            "newton_schulz_split: extra_scale_factor (", extra_scale_factor,
                            ") applies only with a scale_mode; without one the parts are returned unscaled");
  SplitLayout layout;
  std::optional<ScaleMode> mode;
  try {
    layout = plan_split(x.size(-2), split_sizes, num_groups);
    if (scale_mode.has_value()) mode = parse_scale_mode(*scale_mode);
    parse_ns_algorithm(algorithm);
  } catch (const std::invalid_argument& e) {
    MEGATRON_EOPT_CHECK_VALUE(false, "newton_schulz_split: ", e.what());
  }
  // The Newton–Schulz arguments are checked here, before the nested newton_schulz calls: torch
  // 2.11 and 2.12 pass an error raised inside a nested dispatcher call on without its message.
  parse_ns_options(x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm, eps_mode, norm_divisor,
                   row_equilibration, frobenius_renorm, products);

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
    Tensor out = aten::view(
        call_newton_schulz(aten::reshape(x, {batch * parts, size, n}), coefficients, steps, repeat_last, eps, transpose,
                           precision, algorithm, eps_mode, norm_divisor, row_equilibration, frobenius_renorm, products),
        aten::sizes_of(x));
    if (mode) aten::mul_(out, factor(size));
    return out;
  }

  const Tensor grouped = aten::reshape(x, {batch, groups, layout.group_rows, n});
  Tensor out = aten::empty_like(x);
  const Tensor out_grouped = aten::view(out, {batch, groups, layout.group_rows, n});
  for (const SplitGroup& same : layout.same_size) {
    std::vector<Tensor> members;
    members.reserve(same.parts.size());
    for (std::size_t k : same.parts) members.push_back(aten::narrow(grouped, 2, layout.offsets[k], same.size));
    const int64_t count = static_cast<int64_t>(members.size());
    // (batch, count, groups, size, n) stacked contiguous, so each part of each matrix is one
    // (groups * size, n) matrix of a single batched call.
    const Tensor result = aten::view(
        call_newton_schulz(aten::view(aten::stack(members, 1), {batch * count, groups * same.size, n}), coefficients,
                           steps, repeat_last, eps, transpose, precision, algorithm, eps_mode, norm_divisor,
                           row_equilibration, frobenius_renorm, products),
        {batch, count, groups, same.size, n});
    for (int64_t j = 0; j < count; ++j) {
      Tensor dest = aten::narrow(out_grouped, 2, layout.offsets[same.parts[j]], same.size);
      const Tensor src = aten::select(result, 1, j);
      if (mode) {
        aten::mul_out(dest, src, factor(same.size));
      } else {
        aten::copy_(dest, src);
      }
    }
  }
  return out;
}

}  // namespace

// Composed of newton_schulz calls through the dispatcher: one kernel serves every backend that
// implements newton_schulz (the CUDA one lives in the separately loaded CUDA library).
STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CompositeExplicitAutograd, m) {
  m.impl("newton_schulz_split", TORCH_BOX(&newton_schulz_split));
}

}  // namespace megatron_eopt
