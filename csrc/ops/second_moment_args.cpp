#include "ops/second_moment_args.h"

#include <cmath>

#include "ops/aten_ops.h"

#include "ops/foreach_args.h"

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

bool is_supported_input_dtype(ScalarType t) { return t == kFloat || t == kBFloat16 || t == kHalf; }

// grads[i] / ns_inputs[i] of NAMO: a float tensor shaped like updates[i].
void check_namo_input(const char* op, const char* name, std::size_t i, const Tensor& t, const Tensor& update) {
  MEGATRON_EOPT_CHECK_TYPE(is_supported_input_dtype(t.scalar_type()), op, ": ", name, "[", i,
                           "] must be float32, bfloat16 or float16, got ", t.scalar_type());
  MEGATRON_EOPT_CHECK_VALUE(same_values(t.sizes(), update.sizes()), op, ": ", name, "[", i, "] has shape ", t.sizes(),
                            " but updates[", i, "] has shape ", update.sizes());
  MEGATRON_EOPT_CHECK_VALUE(t.device() == update.device(), op, ": ", name, "[", i, "] is on ", t.device(),
                            " but updates[", i, "] is on ", update.device());
}

}  // namespace

Moment2Scalars moment2_scalars(const char* op, const Tensor& beta2, const Tensor& eps,
                               const std::optional<Tensor>& found_inf, const std::optional<Device>& device,
                               DeviceType backend) {
  Moment2Scalars scalars;
  scalars.beta2 = step_scalar(op, "beta2", beta2, device, backend);
  scalars.eps = step_scalar(op, "eps", eps, device, backend);
  scalars.found_inf = step_scalar(op, "found_inf", found_inf, device, backend, /*required=*/false);
  if (backend == kCPU) {  // host memory: the values can be checked without a sync
    const double b = scalars.beta2.load();
    const float e = static_cast<float>(scalars.eps.load());
    MEGATRON_EOPT_CHECK_VALUE(std::isfinite(b) && b >= 0.0 && b <= 1.0, op,
                              ": beta2 must be finite and in [0, 1], got ", b);
    MEGATRON_EOPT_CHECK_VALUE(std::isfinite(e) && e > 0.f, op, ": eps must be finite and positive in float32, got ",
                              scalars.eps.load());
  }
  return scalars;
}

Moment2Scalars check_moment2_args(Moment2Method method, const TensorList& updates, const TensorList& moment2,
                                  const TensorList& grads, const TensorList& ns_inputs, const Tensor& beta2,
                                  const Tensor& eps, const std::optional<Tensor>& grad_scale,
                                  const std::optional<Tensor>& found_inf, DeviceType backend) {
  const char* op = moment2_op_name(method);
  MEGATRON_EOPT_CHECK_VALUE(moment2.size() == updates.size(), op, ": moment2 has ", moment2.size(),
                            " tensors but updates has ", updates.size());
  if (method == Moment2Method::kNamo) {
    MEGATRON_EOPT_CHECK_VALUE(grads.size() == updates.size(), op, ": grads has ", grads.size(),
                              " tensors but updates has ", updates.size());
    MEGATRON_EOPT_CHECK_VALUE(ns_inputs.size() == updates.size(), op, ": ns_inputs has ", ns_inputs.size(),
                              " tensors but updates has ", updates.size());
  }
  const std::optional<Device> device = updates.empty() ? std::nullopt : std::optional<Device>(updates[0].device());
  if (device) {
    MEGATRON_EOPT_CHECK_VALUE(device->type() == backend, op, ": updates[0] is on ", *device, ", expected a ",
                              device_type_name(backend), " tensor");
  }
  Moment2Scalars scalars = moment2_scalars(op, beta2, eps, found_inf, device, backend);
  if (method == Moment2Method::kNamo) {
    scalars.grad_scale = step_scalar(op, "grad_scale", grad_scale, device, backend, /*required=*/false);
  }
  for (std::size_t i = 0; i < updates.size(); ++i) {
    const Tensor& u = updates[i];
    const Tensor& v = moment2[i];
    MEGATRON_EOPT_CHECK_TYPE(u.scalar_type() == kFloat, op, ": updates[", i, "] must be float32, got ",
                             u.scalar_type());
    MEGATRON_EOPT_CHECK_VALUE(u.dim() == 2, op, ": updates[", i, "] must be 2-D, got ", u.dim(), "-D");
    MEGATRON_EOPT_CHECK_VALUE(u.device() == updates[0].device(), op, ": updates[", i, "] is on ", u.device(),
                              " but updates[0] is on ", updates[0].device());
    MEGATRON_EOPT_CHECK_TYPE(v.scalar_type() == kFloat, op, ": moment2[", i, "] must be float32, got ",
                             v.scalar_type());
    MEGATRON_EOPT_CHECK_VALUE(v.device() == u.device(), op, ": moment2[", i, "] is on ", v.device(), " but updates[", i,
                              "] is on ", u.device());
    const std::vector<int64_t> expected = moment2_shape(method, u.size(0), u.size(1));
    // NAMO's scalar state may also be 0-D.
    const bool scalar_ok = method == Moment2Method::kNamo && v.dim() == 0;
    MEGATRON_EOPT_CHECK_VALUE(scalar_ok || same_values(v.sizes(), IntList(expected)), op, ": moment2[", i,
                              "] has shape ", v.sizes(), " but an update of shape ", u.sizes(), " needs ", expected);
    if (method == Moment2Method::kNamo) {
      check_namo_input(op, "grads", i, grads[i], u);
      check_namo_input(op, "ns_inputs", i, ns_inputs[i], u);
    }
  }
  return scalars;
}

InPlaceList::InPlaceList(const TensorList& targets) : targets_(targets.begin(), targets.end()) {
  work_.reserve(targets_.size());
  for (const Tensor& t : targets_) {
    const bool copy = !t.is_contiguous();
    work_.push_back(copy ? aten::contiguous(t) : t);
    copied_.push_back(copy);
  }
}

void InPlaceList::write_back() const {
  for (std::size_t i = 0; i < targets_.size(); ++i) {
    if (copied_[i]) {
      Tensor target = targets_[i];
      aten::copy_(target, work_[i]);
    }
  }
}

}  // namespace megatron_eopt
