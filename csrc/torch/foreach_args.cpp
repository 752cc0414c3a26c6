#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "torch/foreach_args.h"

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

namespace megatron_eopt {
namespace {

// A named list of an op call, for messages like "foreach_update_: updates[3] ...".
struct NamedList {
  const char* name;
  at::TensorList tensors;
  bool written;  // the op writes it (a working copy must be copied back, so it must not overlap)
};

StorageType storage_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return StorageType::kBFloat16;
    case at::kHalf: return StorageType::kFloat16;
    default: return StorageType::kFloat32;  // the checks admit float32, bfloat16 and float16 only
  }
}

bool is_param_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

WeightDecayMethod parse_method(const char* op, c10::string_view name) {
  try {
    return parse_weight_decay_method(std::string_view(name.data(), name.size()));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, op, ": ", e.what());
  }
}

// All tensors of `list` share one dtype, admitted by `allowed`; returns it (nullopt: empty list).
template <typename Allowed>
std::optional<at::ScalarType> list_dtype(const char* op, const NamedList& list, const char* rule,
                                         const Allowed& allowed) {
  std::optional<at::ScalarType> dtype;
  for (std::size_t i = 0; i < list.tensors.size(); ++i) {
    const at::ScalarType t = list.tensors[i].scalar_type();
    TORCH_CHECK_TYPE(allowed(t), op, ": ", list.name, "[", i, "] is ", t, "; ", rule);
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

bool same_dense_layout(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_non_overlapping_and_dense() || !b.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// Index i of every list: the reference's shape; written tensors must not overlap themselves.
void check_index(const char* op, std::size_t i, const NamedList& reference, std::initializer_list<NamedList> lists) {
  const at::Tensor& ref = reference.tensors[i];
  for (const NamedList& list : lists) {
    if (list.tensors.empty()) continue;
    const at::Tensor& t = list.tensors[i];
    TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", list.name, "[", i, "] has shape ", t.sizes(), " but ",
                      reference.name, "[", i, "] has shape ", ref.sizes());
    TORCH_CHECK_VALUE(!list.written || t.numel() == 0 || at::has_internal_overlap(t) != at::MemOverlap::Yes, op,
                      ": ", list.name, "[", i, "] has overlapping memory (strides ", t.strides(),
                      ") and cannot be written in place");
  }
}

// The kernels walk the tensors of one index as flat arrays, so they need one element order. When
// every tensor of the index shares one dense layout they are used as they are; otherwise each
// non-contiguous one is replaced by a contiguous working copy (written ones are copied back).
template <typename Args>
std::vector<at::Tensor> working_tensors(ForeachCall<Args>& call, std::size_t i,
                                        std::initializer_list<NamedList> lists) {
  std::vector<at::Tensor> tensors;
  for (const NamedList& list : lists) tensors.push_back(list.tensors.empty() ? at::Tensor() : list.tensors[i]);
  bool shared = true;
  const at::Tensor& first = tensors.front();
  for (const at::Tensor& t : tensors) shared = shared && (!t.defined() || same_dense_layout(first, t));
  if (shared) return tensors;
  auto list = lists.begin();
  for (at::Tensor& t : tensors) {
    if (t.defined() && !t.is_contiguous()) {
      at::Tensor work = t.contiguous();
      if (list->written) {
        call.outputs.emplace_back(t, work);
      } else {
        call.inputs.push_back(work);
      }
      t = work;
    }
    ++list;
  }
  return tensors;
}

// On the CPU the scalars are host memory, so their values are checked too (on CUDA reading
// them would synchronize: the Python front checks Python numbers, device tensors are the caller's).
// `in_range` (nullptr: any finite value) states the rule spelled out in `rule`.
void check_host_value(const char* op, const char* name, const StepScalar& s, c10::DeviceType backend,
                      bool (*in_range)(double), const char* rule) {
  if (backend != c10::kCPU || !s.present()) return;
  const double v = s.load();
  const bool ok = std::isfinite(v) && (in_range == nullptr || in_range(v));
  TORCH_CHECK_VALUE(ok, op, ": ", name, " must be ", rule, ", got ", v);
}

}  // namespace

StepScalar step_scalar(const char* op, const char* name, const std::optional<at::Tensor>& t,
                       std::optional<at::Device> device, c10::DeviceType backend, bool required) {
  if (!t.has_value() || !t->defined()) {
    TORCH_CHECK_VALUE(!required, op, ": ", name, " must be a 0-dim float32 or float64 tensor, got None");
    return {};
  }
  TORCH_CHECK_VALUE(t->dim() == 0, op, ": ", name, " must be a 0-dim float32 or float64 tensor, got shape ",
                    t->sizes());
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble, op, ": ", name,
                   " must be a 0-dim float32 or float64 tensor, got ", t->scalar_type());
  if (device) {
    TORCH_CHECK_VALUE(t->device() == *device, op, ": ", name, " is on ", t->device(),
                      " but the tensor lists are on ", *device, "; pass it as a 0-dim tensor on their device");
  } else {
    TORCH_CHECK_VALUE(t->device().type() == backend, op, ": ", name, " is on ", t->device(), ", expected a ",
                      c10::DeviceTypeName(backend, /*lower_case=*/true), " tensor");
  }
  return StepScalar{t->const_data_ptr(), t->scalar_type() == at::kDouble};
}

ForeachCall<ForeachMomentumArgs> parse_foreach_momentum(
    at::TensorList grads, at::TensorList momentum_buffers, at::TensorList ns_inputs, at::TensorList params,
    const at::Tensor& momentum, bool nesterov, const at::Tensor& weight_decay, c10::string_view weight_decay_method,
    const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
    c10::DeviceType backend) {
  constexpr const char* op = "foreach_momentum_";
  const NamedList g{"grads", grads, false}, m{"momentum_buffers", momentum_buffers, true},
      n{"ns_inputs", ns_inputs, true}, p{"params", params, false};
  const WeightDecayMethod method = parse_method(op, weight_decay_method);
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

  const auto grad_dtype = list_dtype(op, g, "grads must be float32, bfloat16 or float16", is_param_dtype);
  if (grad_dtype) {
    const at::ScalarType gd = *grad_dtype;
    list_dtype(op, p, "params must have the gradients' dtype", [&](at::ScalarType t) { return t == gd; });
    list_dtype(op, m, "momentum buffers must be float32 or the gradients' dtype",
               [&](at::ScalarType t) { return t == gd || t == at::kFloat; });
  }
  const auto ns_dtype = list_dtype(op, n, "ns_inputs must be float32 or bfloat16",
                                   [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; });
  const auto device = common_device(op, {g, m, n, p}, backend);

  ForeachCall<ForeachMomentumArgs> call;
  ForeachMomentumArgs& args = call.args;
  args.momentum = step_scalar(op, "momentum", momentum, device, backend);
  args.weight_decay = step_scalar(op, "weight_decay", weight_decay, device, backend);
  args.grad_scale = step_scalar(op, "grad_scale", grad_scale, device, backend, /*required=*/false);
  args.found_inf = step_scalar(op, "found_inf", found_inf, device, backend, /*required=*/false);
  check_host_value(op, "momentum", args.momentum, backend, [](double v) { return v >= 0.0 && v < 1.0; },
                   "finite and in [0, 1)");
  check_host_value(op, "weight_decay", args.weight_decay, backend, nullptr, "finite");
  for (std::size_t i = 0; i < grads.size(); ++i) check_index(op, i, g, {m, n, p});

  args.grad_type = storage_type(grad_dtype.value_or(at::kFloat));
  args.buffer_type = storage_type(momentum_buffers.empty() ? at::kFloat : momentum_buffers[0].scalar_type());
  args.ns_type = storage_type(ns_dtype.value_or(at::kFloat));
  args.nesterov = nesterov;
  args.l2 = method == WeightDecayMethod::kL2;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].numel() == 0) continue;
    const std::vector<at::Tensor> t =
        args.l2 ? working_tensors(call, i, {g, m, n, p}) : working_tensors(call, i, {g, m, n});
    args.grads.push_back(t[0].const_data_ptr());
    args.buffers.push_back(t[1].data_ptr());
    args.ns_inputs.push_back(t[2].data_ptr());
    if (args.l2) args.params.push_back(t[3].const_data_ptr());
    args.numels.push_back(grads[i].numel());
  }
  return call;
}

ForeachCall<ForeachUpdateArgs> parse_foreach_update(at::TensorList params, at::TensorList updates,
                                                    c10::ArrayRef<double> scales, const at::Tensor& lr,
                                                    const at::Tensor& weight_decay,
                                                    c10::string_view weight_decay_method,
                                                    const std::optional<at::Tensor>& found_inf,
                                                    c10::DeviceType backend) {
  constexpr const char* op = "foreach_update_";
  const NamedList p{"params", params, true}, u{"updates", updates, false};
  const WeightDecayMethod method = parse_method(op, weight_decay_method);
  check_length(op, u, p);
  TORCH_CHECK_VALUE(scales.size() == params.size(), op, ": scales has ", scales.size(), " values but ",
                    params.size(), " params were given");
  for (std::size_t i = 0; i < scales.size(); ++i) {
    TORCH_CHECK_VALUE(std::isfinite(static_cast<float>(scales[i])), op, ": scales[", i,
                      "] must be finite in float32, got ", scales[i]);
  }
  const auto param_dtype = list_dtype(op, p, "params must be float32, bfloat16 or float16", is_param_dtype);
  if (param_dtype) {
    const at::ScalarType pd = *param_dtype;
    list_dtype(op, u, "updates must be float32 or the parameters' dtype",
               [&](at::ScalarType t) { return t == pd || t == at::kFloat; });
  }
  const auto device = common_device(op, {p, u}, backend);

  ForeachCall<ForeachUpdateArgs> call;
  ForeachUpdateArgs& args = call.args;
  args.lr = step_scalar(op, "lr", lr, device, backend);
  args.weight_decay = step_scalar(op, "weight_decay", weight_decay, device, backend);
  args.found_inf = step_scalar(op, "found_inf", found_inf, device, backend, /*required=*/false);
  check_host_value(op, "lr", args.lr, backend, nullptr, "finite");
  check_host_value(op, "weight_decay", args.weight_decay, backend, nullptr, "finite");
  for (std::size_t i = 0; i < params.size(); ++i) check_index(op, i, p, {u});

  args.param_type = storage_type(param_dtype.value_or(at::kFloat));
  args.update_type = storage_type(updates.empty() ? at::kFloat : updates[0].scalar_type());
  args.method = method;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    const std::vector<at::Tensor> t = working_tensors(call, i, {p, u});
    args.params.push_back(t[0].data_ptr());
    args.updates.push_back(t[1].const_data_ptr());
    args.scales.push_back(static_cast<float>(scales[i]));
    args.numels.push_back(params[i].numel());
  }
  return call;
}

}  // namespace megatron_eopt
