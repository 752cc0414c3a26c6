#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "torch/foreach_args.h"

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

namespace megatron_eopt {
namespace {

// A named list of an op call, for messages like "foreach_update_: updates[3] ...".
struct NamedList {
  const char* name;
  at::TensorList tensors;
};

StorageType storage_type(at::ScalarType t) {
  return t == at::kBFloat16 ? StorageType::kBFloat16 : StorageType::kFloat32;
}

WeightDecayMethod parse_method(const char* op, c10::string_view name) {
  try {
    return parse_weight_decay_method(std::string_view(name.data(), name.size()));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, op, ": ", e.what());
  }
}

// All tensors of `list` share one dtype, among float32 / bfloat16 (or exactly `required`).
std::optional<at::ScalarType> list_dtype(const char* op, const NamedList& list, const char* rule,
                                         std::optional<at::ScalarType> required = std::nullopt,
                                         bool allow_float32 = true) {
  std::optional<at::ScalarType> dtype;
  for (std::size_t i = 0; i < list.tensors.size(); ++i) {
    const at::ScalarType t = list.tensors[i].scalar_type();
    const bool ok = required ? (t == *required || (allow_float32 && t == at::kFloat))
                             : (t == at::kFloat || t == at::kBFloat16);
    TORCH_CHECK_TYPE(ok, op, ": ", list.name, "[", i, "] is ", t, "; ", rule);
    if (!dtype) dtype = t;
    TORCH_CHECK_TYPE(t == *dtype, op, ": ", list.name, "[", i, "] is ", t, " but ", list.name, "[0] is ", *dtype,
                     "; all ", list.name, " must share one dtype");
  }
  return dtype;
}

void check_length(const char* op, const NamedList& list, const NamedList& reference) {
  TORCH_CHECK_VALUE(list.tensors.size() == reference.tensors.size(), op, ": ", list.name, " has ",
                    list.tensors.size(), " tensors but ", reference.tensors.size(), " ", reference.name,
                    " were given");
}

// Same device for every tensor, of the backend's type; returns that device (nullopt: no tensor).
std::optional<at::Device> common_device(const char* op, std::initializer_list<NamedList> lists,
                                        c10::DeviceType backend) {
  std::optional<at::Device> device;
  const char* first_name = nullptr;
  for (const NamedList& list : lists) {
    for (std::size_t i = 0; i < list.tensors.size(); ++i) {
      const at::Device d = list.tensors[i].device();
      if (!device) {
        device = d;
        first_name = list.name;
        TORCH_CHECK_VALUE(d.type() == backend, op, ": ", list.name, "[", i, "] is on ", d, ", expected a ",
                          c10::DeviceTypeName(backend, /*lower_case=*/true), " tensor");
      }
      TORCH_CHECK_VALUE(d == *device, op, ": ", list.name, "[", i, "] is on ", d, " but ", first_name,
                        "[0] is on ", *device, "; all tensors must be on one device");
    }
  }
  return device;
}

// A per-step scalar: a 0-dim float32 tensor on the lists' device.
void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t, std::optional<at::Device> device,
                         c10::DeviceType backend) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " must be a 0-dim float32 tensor, got an undefined tensor");
  TORCH_CHECK_VALUE(t.dim() == 0, op, ": ", name, " must be a 0-dim float32 tensor, got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " must be a 0-dim float32 tensor, got ",
                   t.scalar_type());
  if (device) {
    TORCH_CHECK_VALUE(t.device() == *device, op, ": ", name, " is on ", t.device(), " but the tensor lists are on ",
                      *device, "; pass it as a 0-dim tensor on their device");
  } else {
    TORCH_CHECK_VALUE(t.device().type() == backend, op, ": ", name, " is on ", t.device(), ", expected a ",
                      c10::DeviceTypeName(backend, /*lower_case=*/true), " tensor");
  }
}

// Every list's tensor i has the reference's shape and the same dense memory order, so the kernels
// can walk all of them as flat arrays from their data pointers.
void check_index(const char* op, std::size_t i, const NamedList& reference, std::initializer_list<NamedList> others) {
  const at::Tensor& ref = reference.tensors[i];
  const bool empty = ref.numel() == 0;
  TORCH_CHECK_VALUE(empty || ref.is_non_overlapping_and_dense(), op, ": ", reference.name, "[", i,
                    "] must be contiguous (or dense and non-overlapping), got strides ", ref.strides());
  for (const NamedList& list : others) {
    if (list.tensors.empty()) continue;
    const at::Tensor& t = list.tensors[i];
    TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", list.name, "[", i, "] has shape ", t.sizes(), " but ",
                      reference.name, "[", i, "] has shape ", ref.sizes());
    if (empty) continue;
    bool same_order = t.is_non_overlapping_and_dense();
    for (int64_t d = 0; same_order && d < t.dim(); ++d) {
      same_order = t.size(d) == 1 || t.stride(d) == ref.stride(d);
    }
    TORCH_CHECK_VALUE(same_order, op, ": ", list.name, "[", i, "] has strides ", t.strides(), " but ",
                      reference.name, "[", i, "] has strides ", ref.strides(),
                      "; the tensors of one index must share one dense layout (e.g. all contiguous)");
  }
}

}  // namespace

ForeachMomentumArgs parse_foreach_momentum(at::TensorList grads, at::TensorList momentum_buffers,
                                           at::TensorList ns_inputs, at::TensorList params, double momentum,
                                           bool nesterov, const at::Tensor& weight_decay,
                                           c10::string_view weight_decay_method, c10::DeviceType backend) {
  constexpr const char* op = "foreach_momentum_";
  const NamedList g{"grads", grads}, m{"momentum_buffers", momentum_buffers}, n{"ns_inputs", ns_inputs},
      p{"params", params};
  const WeightDecayMethod method = parse_method(op, weight_decay_method);
  TORCH_CHECK_VALUE(std::isfinite(momentum) && momentum >= 0.0 && momentum < 1.0, op,
                    ": momentum must be finite and in [0, 1), got ", momentum);
  check_length(op, m, g);
  check_length(op, n, g);
  if (method == WeightDecayMethod::kL2) {
    TORCH_CHECK_VALUE(params.size() == grads.size(), op,
                      ": weight_decay_method 'l2' reads the parameters: params must have one tensor per "
                      "gradient, got ",
                      params.size(), " for ", grads.size(), " grads");
  } else if (!params.empty()) {
    check_length(op, p, g);
  }

  const auto grad_dtype = list_dtype(op, g, "grads must be float32 or bfloat16");
  if (grad_dtype) {
    list_dtype(op, p, "params must have the gradients' dtype", grad_dtype, /*allow_float32=*/false);
    list_dtype(op, m, "momentum buffers must be float32 or the gradients' dtype", grad_dtype);
  }
  const auto ns_dtype = list_dtype(op, n, "ns_inputs must be float32 or bfloat16");
  const auto device = common_device(op, {g, m, n, p}, backend);
  check_scalar_tensor(op, "weight_decay", weight_decay, device, backend);
  for (std::size_t i = 0; i < grads.size(); ++i) check_index(op, i, g, {m, n, p});

  ForeachMomentumArgs args;
  args.grad_type = storage_type(grad_dtype.value_or(at::kFloat));
  args.buffer_type = storage_type(momentum_buffers.empty() ? at::kFloat : momentum_buffers[0].scalar_type());
  args.ns_type = storage_type(ns_dtype.value_or(at::kFloat));
  args.coefficients.ema_weight = static_cast<float>(1.0 - momentum);
  args.coefficients.nesterov_weight = static_cast<float>(momentum);
  args.coefficients.nesterov = nesterov;
  args.l2 = method == WeightDecayMethod::kL2;
  args.weight_decay = weight_decay.const_data_ptr<float>();
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].numel() == 0) continue;
    args.grads.push_back(grads[i].const_data_ptr());
    args.buffers.push_back(momentum_buffers[i].data_ptr());
    args.ns_inputs.push_back(ns_inputs[i].data_ptr());
    if (args.l2) args.params.push_back(params[i].const_data_ptr());
    args.numels.push_back(grads[i].numel());
  }
  return args;
}

ForeachUpdateArgs parse_foreach_update(at::TensorList params, at::TensorList updates, c10::ArrayRef<double> scales,
                                       const at::Tensor& lr, const at::Tensor& weight_decay,
                                       c10::string_view weight_decay_method, c10::DeviceType backend) {
  constexpr const char* op = "foreach_update_";
  const NamedList p{"params", params}, u{"updates", updates};
  const WeightDecayMethod method = parse_method(op, weight_decay_method);
  check_length(op, u, p);
  TORCH_CHECK_VALUE(scales.size() == params.size(), op, ": scales has ", scales.size(), " values but ",
                    params.size(), " params were given");
  for (std::size_t i = 0; i < scales.size(); ++i) {
    TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(scales[i])), op, ": scales[", i,
                      "] must be finite in float32, got ", scales[i]);
  }
  const auto param_dtype = list_dtype(op, p, "params must be float32 or bfloat16");
  if (param_dtype) list_dtype(op, u, "updates must be float32 or the parameters' dtype", param_dtype);
  const auto device = common_device(op, {p, u}, backend);
  check_scalar_tensor(op, "lr", lr, device, backend);
  check_scalar_tensor(op, "weight_decay", weight_decay, device, backend);
  for (std::size_t i = 0; i < params.size(); ++i) check_index(op, i, p, {u});

  ForeachUpdateArgs args;
  args.param_type = storage_type(param_dtype.value_or(at::kFloat));
  args.update_type = storage_type(updates.empty() ? at::kFloat : updates[0].scalar_type());
  args.method = method;
  args.lr = lr.const_data_ptr<float>();
  args.weight_decay = weight_decay.const_data_ptr<float>();
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    args.params.push_back(params[i].data_ptr());
    args.updates.push_back(updates[i].const_data_ptr());
    args.scales.push_back(static_cast<float>(scales[i]));
    args.numels.push_back(params[i].numel());
  }
  return args;
}

}  // namespace megatron_eopt
