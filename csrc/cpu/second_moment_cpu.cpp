// Second-moment normalizations on the CPU: the same per-element / per-slice / per-matrix math as
// the CUDA kernels (megatron_eopt/second_moment_math.h), reductions accumulated in double,
// parallelized with torch's parallel_for.

#include <algorithm>
#include <optional>
#include <vector>

#include "cpu/cpu_clones.h"
#include "megatron_eopt/second_moment_math.h"
#include "megatron_eopt/storage_types.h"
#include "ops/aten_ops.h"
#include "ops/second_moment_args.h"

namespace megatron_eopt {
namespace {

// Elements per parallel task: small matrices stay on one thread.
constexpr int64_t kGrainElements = 32768;

int64_t grain_for(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

// Sum of squares of p[begin, end) in double. Independent lane accumulators let the compiler
// vectorize without reassociating (a single accumulator is a serial dependency chain).
template <typename T>
MEGATRON_EOPT_CPU_CLONES double sum_squares_range(const T* p, int64_t begin, int64_t end) {
  constexpr int kLanes = 8;
  double lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const double x = to_float(p[i + l]);
      lanes[l] += x * x;
    }
  }
  double total = 0.0;
  for (; i < end; ++i) {
    const double x = to_float(p[i]);
    total += x * x;
  }
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

MEGATRON_EOPT_CPU_CLONES void adamuon_range(float* __restrict__ o, float* __restrict__ v, int64_t begin, int64_t end,
                                            float weight, float eps) {
  for (int64_t i = begin; i < end; ++i) o[i] = adamuon_normalize(o[i], v[i], weight, eps);
}

void adamuon_one(float* o, float* v, int64_t numel, float weight, float eps) {
  torch::stable::parallel_for(0, numel, kGrainElements,
                              [&](int64_t begin, int64_t end) { adamuon_range(o, v, begin, end, weight, eps); });
}

// Sum over [begin, end) of the fp32-rounded squares of p (the reference squares in fp32, then
// reduces), accumulated in double.
MEGATRON_EOPT_CPU_CLONES double sum_rounded_squares_range(const float* p, int64_t begin, int64_t end) {
  constexpr int kLanes = 8;
  double lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(mul_rn(p[i + l], p[i + l]));
  }
  double total = 0.0;
  for (; i < end; ++i) total += static_cast<double>(mul_rn(p[i], p[i]));
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// NorMuon in Emerging-Optimizers 0.4's order of operations at fp32 (AdaptiveMuon's
// _apply_moment2_normalization): the slice means of the fp32 squares O*O; U' = fl(O * step); the
// norm ratio ||O||_F / max(||U'||_F, eps) from the rounded U' (not step^2 * slice sums: U' is what
// the reference measures); the result fl(U' * ratio). Reductions run in double and are rounded to
// fp32 once, where the reference accumulates in fp32: results differ from it by the reference's
// own summation error (a few ulp at most, see test_second_moment.py).
void normuon_one(float* o, float* v, int64_t rows, int64_t cols, float weight, float eps) {
  if (rows * cols == 0) return;  // nothing to normalize; the state is left as is
  const bool by_row = rows >= cols;
  const int64_t slices = by_row ? rows : cols;
  const int64_t slice_len = by_row ? cols : rows;
  std::vector<double> sums(static_cast<std::size_t>(slices), 0.0);
  if (by_row) {
    torch::stable::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) sums[r] = sum_rounded_squares_range(o + r * cols, 0, cols);
    });
  } else {  // column sums, row by row over a block of columns (cache friendly)
    torch::stable::parallel_for(0, cols, grain_for(rows), [&](int64_t begin, int64_t end) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = o + r * cols;
        for (int64_t c = begin; c < end; ++c) sums[c] += static_cast<double>(mul_rn(row[c], row[c]));
      }
    });
  }
  std::vector<float> steps(static_cast<std::size_t>(slices));
  for (int64_t j = 0; j < slices; ++j) {
    steps[j] = normuon_slice_step(v[j], static_cast<float>(sums[j]), slice_len, weight, eps);
  }
  // ||O||^2 and ||U'||^2 per row (exact squares of the fp32 values, as a norm reduces them), summed
  // in row order: the result does not depend on the thread count.
  std::vector<double> row_o(static_cast<std::size_t>(rows), 0.0);
  std::vector<double> row_u(static_cast<std::size_t>(rows), 0.0);
  torch::stable::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      double so = 0.0;
      double su = 0.0;
      for (int64_t c = 0; c < cols; ++c) {
        const float x = o[r * cols + c];
        const float u = mul_rn(x, steps[by_row ? r : c]);
        so += static_cast<double>(x) * x;
        su += static_cast<double>(u) * u;
      }
      row_o[r] = so;
      row_u[r] = su;
    }
  });
  double sum_o = 0.0;
  double sum_u = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    sum_o += row_o[r];
    sum_u += row_u[r];
  }
  const float ratio = normuon_norm_ratio(static_cast<float>(sum_o), static_cast<float>(sum_u), eps);
  torch::stable::parallel_for(0, rows, grain_for(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < cols; ++c) o[r * cols + c] = o[r * cols + c] * steps[by_row ? r : c] * ratio;
    }
  });
}

// Fixed chunks of kGrainElements, summed in order: the result does not depend on the thread count.
template <typename T>
double sum_squares_of(const T* p, int64_t numel) {
  const int64_t chunks = (numel + kGrainElements - 1) / kGrainElements;
  std::vector<double> partial(static_cast<std::size_t>(chunks), 0.0);
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      partial[c] = sum_squares_range(p, c * kGrainElements, std::min(numel, (c + 1) * kGrainElements));
    }
  });
  double total = 0.0;
  for (double v : partial) total += v;
  return total;
}

// grads / ns_inputs of NAMO: float32, bfloat16 or float16 (the checks admit no other dtype).
double sum_squares(const Tensor& t) {
  const Tensor x = aten::contiguous(t);
  const void* p = x.const_data_ptr();
  switch (x.scalar_type()) {
    case kBFloat16: return sum_squares_of(static_cast<const Bf16*>(p), x.numel());
    case kHalf: return sum_squares_of(static_cast<const Fp16*>(p), x.numel());
    default: return sum_squares_of(static_cast<const float*>(p), x.numel());
  }
}

// AdaMuon (elementwise) and NorMuon (per row or column): the two normalizations that read only
// the update and its statistics.
template <Moment2Method kMethod>
void moment2_normalize_cpu(const TensorList& updates, const TensorList& moment2, const Tensor& beta2, const Tensor& eps,
                           const std::optional<Tensor>& found_inf) {
  const Moment2Scalars scalars = check_moment2_args(kMethod, updates, moment2, {}, {}, beta2, eps, std::nullopt,
                                                    found_inf, kCPU);
  if (step_skipped(scalars.found_inf)) return;
  const Moment2Step h = moment2_step(scalars);
  const InPlaceList o(updates), v(moment2);
  for (std::size_t i = 0; i < updates.size(); ++i) {
    float* update = o[i].mutable_data_ptr<float>();
    float* stats = v[i].mutable_data_ptr<float>();
    if constexpr (kMethod == Moment2Method::kAdamuon) {
      adamuon_one(update, stats, o[i].numel(), h.weight, h.eps);
    } else {
      normuon_one(update, stats, o[i].size(0), o[i].size(1), h.weight, h.eps);
    }
  }
  o.write_back();
  v.write_back();
}

void namo_normalize_cpu(const TensorList& updates, const TensorList& moment2, const TensorList& grads,
                        const TensorList& ns_inputs, const Tensor& beta2, const Tensor& eps,
                        const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf) {
  const Moment2Scalars scalars = check_moment2_args(Moment2Method::kNamo, updates, moment2, grads, ns_inputs, beta2,
                                                    eps, grad_scale, found_inf, kCPU);
  if (step_skipped(scalars.found_inf)) return;
  const Moment2Step h = moment2_step(scalars);
  const double scale = scalars.grad_scale.load_or(1.0);
  const InPlaceList o(updates), v(moment2);
  for (std::size_t i = 0; i < updates.size(); ++i) {
    const float grad_sum_sq = namo_grad_sum_sq(static_cast<float>(sum_squares(grads[i])), scale);
    const float factor = namo_scale(*v[i].mutable_data_ptr<float>(), grad_sum_sq,
                                    static_cast<float>(sum_squares(ns_inputs[i])), h.weight, h.eps);
    float* out = o[i].mutable_data_ptr<float>();
    torch::stable::parallel_for(0, o[i].numel(), kGrainElements, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) out[j] *= factor;
    });
  }
  o.write_back();
  v.write_back();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CPU, m) {
  m.impl("adamuon_normalize_", TORCH_BOX(&moment2_normalize_cpu<Moment2Method::kAdamuon>));
  m.impl("normuon_normalize_", TORCH_BOX(&moment2_normalize_cpu<Moment2Method::kNormuon>));
  m.impl("namo_normalize_", TORCH_BOX(&namo_normalize_cpu));
}

}  // namespace megatron_eopt
