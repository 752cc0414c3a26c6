#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "torch/second_moment_args.h"

#include <cmath>

#include <c10/util/Exception.h>

#include "torch/foreach_args.h"

namespace megatron_eopt {

const char* moment2_op_name(Moment2Method method) {
  switch (method) {
    case Moment2Method::kAdamuon: return "adamuon_normalize_";
    case Moment2Method::kNormuon: return "normuon_normalize_";
    case Moment2Method::kNamo: return "namo_normalize_";
  }
  return "second moment normalization";
}

std::vector<int64_t> moment2_shape(Moment2Method method, int64_t rows, int64_t cols) {
  switch (method) {
    case Moment2Method::kAdamuon: return {rows, cols};
    case Moment2Method::kNormuon: return rows >= cols ? std::vector<int64_t>{rows, 1} : std::vector<int64_t>{1, cols};
    case Moment2Method::kNamo: return {1};
  }
  return {};
}

namespace {

bool is_supported_input_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// grads[i] / ns_inputs[i] of NAMO: a float tensor shaped like updates[i].
void check_namo_input(const char* op, const char* name, std::size_t i, const at::Tensor& t, const at::Tensor& update) {
  TORCH_CHECK_TYPE(is_supported_input_dtype(t.scalar_type()), op, ": ", name, "[", i,
                   "] must be float32, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == update.sizes(), op, ": ", name, "[", i, "] has shape ", t.sizes(),
                    " but updates[", i, "] has shape ", update.sizes());
  TORCH_CHECK_VALUE(t.device() == update.device(), op, ": ", name, "[", i, "] is on ", t.device(),
                    " but updates[", i, "] is on ", update.device());
}

}  // namespace

Moment2Scalars check_moment2_args(Moment2Method method, at::TensorList updates, at::TensorList moment2,
                                  at::TensorList grads, at::TensorList ns_inputs, const at::Tensor& beta2,
                                  const at::Tensor& eps, const std::optional<at::Tensor>& grad_scale,
                                  const std::optional<at::Tensor>& found_inf, c10::DeviceType backend) {
  const char* op = moment2_op_name(method);
  TORCH_CHECK_VALUE(moment2.size() == updates.size(), op, ": moment2 has ", moment2.size(),
                    " tensors but updates has ", updates.size());
  if (method == Moment2Method::kNamo) {
    TORCH_CHECK_VALUE(grads.size() == updates.size(), op, ": grads has ", grads.size(), " tensors but updates has ",
                      updates.size());
    TORCH_CHECK_VALUE(ns_inputs.size() == updates.size(), op, ": ns_inputs has ", ns_inputs.size(),
                      " tensors but updates has ", updates.size());
  }
  const std::optional<at::Device> device =
      updates.empty() ? std::nullopt : std::optional<at::Device>(updates[0].device());
  if (device) {
    TORCH_CHECK_VALUE(device->type() == backend, op, ": updates[0] is on ", *device, ", expected a ",
                      c10::DeviceTypeName(backend, /*lower_case=*/true), " tensor");
  }
  Moment2Scalars scalars;
  scalars.beta2 = step_scalar(op, "beta2", beta2, device, backend);
  scalars.eps = step_scalar(op, "eps", eps, device, backend);
  scalars.found_inf = step_scalar(op, "found_inf", found_inf, device, backend, /*required=*/false);
  if (method == Moment2Method::kNamo) {
    scalars.grad_scale = step_scalar(op, "grad_scale", grad_scale, device, backend, /*required=*/false);
  }
  if (backend == c10::kCPU) {  // host memory: the values can be checked without a sync
    const double b = scalars.beta2.load();
    const float e = static_cast<float>(scalars.eps.load());
    TORCH_CHECK_VALUE(std::isfinite(b) && b >= 0.0 && b <= 1.0, op, ": beta2 must be finite and in [0, 1], got ", b);
    TORCH_CHECK_VALUE(std::isfinite(e) && e > 0.f, op, ": eps must be finite and positive in float32, got ",
                      scalars.eps.load());
  }
  for (std::size_t i = 0; i < updates.size(); ++i) {
    const at::Tensor& u = updates[i];
    const at::Tensor& v = moment2[i];
    TORCH_CHECK_TYPE(u.scalar_type() == at::kFloat, op, ": updates[", i, "] must be float32, got ", u.scalar_type());
    TORCH_CHECK_VALUE(u.dim() == 2, op, ": updates[", i, "] must be 2-D, got ", u.dim(), "-D");
    TORCH_CHECK_VALUE(u.device() == updates[0].device(), op, ": updates[", i, "] is on ", u.device(),
                      " but updates[0] is on ", updates[0].device());
    TORCH_CHECK_TYPE(v.scalar_type() == at::kFloat, op, ": moment2[", i, "] must be float32, got ", v.scalar_type());
    TORCH_CHECK_VALUE(v.device() == u.device(), op, ": moment2[", i, "] is on ", v.device(), " but updates[", i,
                      "] is on ", u.device());
    const std::vector<int64_t> expected = moment2_shape(method, u.size(0), u.size(1));
    // NAMO's scalar state may also be 0-D.
    const bool scalar_ok = method == Moment2Method::kNamo && v.dim() == 0;
    TORCH_CHECK_VALUE(scalar_ok || v.sizes() == c10::IntArrayRef(expected), op, ": moment2[", i, "] has shape ",
                      v.sizes(), " but an update of shape ", u.sizes(), " needs ", c10::IntArrayRef(expected));
    if (method == Moment2Method::kNamo) {
      check_namo_input(op, "grads", i, grads[i], u);
      check_namo_input(op, "ns_inputs", i, ns_inputs[i], u);
    }
  }
  return scalars;
}

InPlaceList::InPlaceList(at::TensorList targets) : targets_(targets.begin(), targets.end()) {
  work_.reserve(targets_.size());
  for (const at::Tensor& t : targets_) work_.push_back(t.contiguous());
}

void InPlaceList::write_back() const {
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    if (!work_[i].is_same(targets_[i])) targets_[i].copy_(work_[i]);
  }
}

}  // namespace megatron_eopt
