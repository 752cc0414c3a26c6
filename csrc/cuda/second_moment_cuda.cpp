// CUDA glue of the second-moment normalizations: checks, device guard, contiguous working tensors,
// scratch from the caching allocator, current stream; the work is in kernels/*_normalize.cu.
#include <algorithm>
#include <optional>
#include <vector>

#include "megatron_eopt/second_moment_cuda.h"
#include "ops/aten_ops.h"
#include "cuda/cuda_context.h"
#include "ops/second_moment_args.h"

namespace megatron_eopt {
namespace {

std::vector<Moment2Tensor> describe(const InPlaceList& o, const InPlaceList& v, std::size_t count) {
  std::vector<Moment2Tensor> list(count);
  for (std::size_t i = 0; i < count; ++i) {
    list[i].update = o[i].mutable_data_ptr<float>();
    list[i].moment2 = v[i].mutable_data_ptr<float>();
    list[i].rows = o[i].size(0);
    list[i].cols = o[i].size(1);
  }
  return list;
}

Tensor scratch_floats(std::size_t count, const Tensor& like) {
  return aten::empty({static_cast<int64_t>(std::max<std::size_t>(count, 1))}, kFloat, like.device());
}

// AdaMuon (elementwise) and NorMuon (per row or column, with scratch for its partial sums): the two
// normalizations that read only the update and its statistics.
template <Moment2Method kMethod>
void moment2_normalize_cuda_op(const TensorList& updates, const TensorList& moment2, const Tensor& beta2,
                               const Tensor& eps, const std::optional<Tensor>& found_inf) {
  const Moment2Scalars scalars = check_moment2_args(kMethod, updates, moment2, {}, {}, beta2, eps, std::nullopt,
                                                    found_inf, kCUDA);
  if (updates.empty()) return;
  const cuda::OpDevice device(updates[0]);
  const InPlaceList o(updates), v(moment2);
  const std::vector<Moment2Tensor> list = describe(o, v, updates.size());
  if constexpr (kMethod == Moment2Method::kAdamuon) {
    adamuon_normalize_cuda(list, scalars, device.stream);
  } else {
    const Tensor scratch = scratch_floats(normuon_scratch_floats(list), o[0]);
    normuon_normalize_cuda(list, scalars, scratch.mutable_data_ptr<float>(), device.stream);
  }
  o.write_back();
  v.write_back();
}

void namo_normalize_cuda_op(const TensorList& updates, const TensorList& moment2, const TensorList& grads,
                            const TensorList& ns_inputs, const Tensor& beta2, const Tensor& eps,
                            const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf) {
  const Moment2Scalars scalars = check_moment2_args(Moment2Method::kNamo, updates, moment2, grads, ns_inputs, beta2,
                                                    eps, grad_scale, found_inf, kCUDA);
  if (updates.empty()) return;
  const cuda::OpDevice device(updates[0]);
  const InPlaceList o(updates), v(moment2);
  std::vector<Tensor> inputs;  // keeps contiguous copies of the read-only inputs alive
  inputs.reserve(2 * updates.size());
  std::vector<Moment2Tensor> list = describe(o, v, updates.size());
  for (std::size_t i = 0; i < updates.size(); ++i) {
    inputs.push_back(aten::contiguous(grads[i]));
    list[i].grad = inputs.back().const_data_ptr();
    list[i].grad_type = storage_type(grads[i].scalar_type());
    inputs.push_back(aten::contiguous(ns_inputs[i]));
    list[i].ns_input = inputs.back().const_data_ptr();
    list[i].ns_input_type = storage_type(ns_inputs[i].scalar_type());
  }
  const Tensor scratch = scratch_floats(namo_scratch_floats(list), o[0]);
  namo_normalize_cuda(list, scalars, scratch.mutable_data_ptr<float>(), device.stream);
  o.write_back();
  v.write_back();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) {
  m.impl("adamuon_normalize_", TORCH_BOX(&moment2_normalize_cuda_op<Moment2Method::kAdamuon>));
  m.impl("normuon_normalize_", TORCH_BOX(&moment2_normalize_cuda_op<Moment2Method::kNormuon>));
  m.impl("namo_normalize_", TORCH_BOX(&namo_normalize_cuda_op));
}

}  // namespace megatron_eopt
