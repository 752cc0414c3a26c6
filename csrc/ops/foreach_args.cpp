#include "ops/foreach_args.h"

#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include "megatron_eopt/strided_layout.h"

namespace megatron_eopt {
namespace {

// A named list of an op call, for messages like "foreach_update_: updates[3] ...".
struct NamedList {
  const char* name;
  const TensorList& tensors;
  bool written;  // the op writes it (a working copy must be copied back, so it must not overlap)
};

bool is_param_dtype(ScalarType t) { return t == kFloat || t == kBFloat16 || t == kHalf; }

WeightDecayMethod parse_method(const char* op, const std::string& name) {
  try {
    return parse_weight_decay_method(std::string_view(name.data(), name.size()));
  } catch (const std::invalid_argument& e) {
    MEGATRON_EOPT_CHECK_VALUE(false, op, ": ", e.what());
  }
}

// All tensors of `list` share one dtype, admitted by `allowed`; returns it (nullopt: empty list).
template <typename Allowed>
std::optional<ScalarType> list_dtype(const char* op, const NamedList& list, const char* rule, const Allowed& allowed) {
  std::optional<ScalarType> dtype;
  for (std::size_t i = 0; i < list.tensors.size(); ++i) {
    const ScalarType t = list.tensors[i].scalar_type();
    MEGATRON_EOPT_CHECK_TYPE(allowed(t), op, ": ", list.name, "[", i, "] is ", t, "; ", rule);
    if (!dtype) dtype = t;
    MEGATRON_EOPT_CHECK_TYPE(t == *dtype, op, ": ", list.name, "[", i, "] is ", t, " but ", list.name, "[0] is ",
                             *dtype, "; all ", list.name, " must share one dtype");
  }
  return dtype;
}

void check_length(const char* op, const NamedList& list, const NamedList& reference) {
  MEGATRON_EOPT_CHECK_VALUE(list.tensors.size() == reference.tensors.size(), op, ": ", list.name, " has ",
                            list.tensors.size(), " tensors but ", reference.tensors.size(), " ", reference.name,
                            " were given");
}

// Same device for every tensor, of the backend's type; returns that device (nullopt: no tensor).
std::optional<Device> common_device(const char* op, std::initializer_list<NamedList> lists, DeviceType backend) {
  std::optional<Device> device;
  const char* first_name = nullptr;
  for (const NamedList& list : lists) {
    for (std::size_t i = 0; i < list.tensors.size(); ++i) {
      const Device d = list.tensors[i].device();
      if (!device) {
        device = d;
        first_name = list.name;
        MEGATRON_EOPT_CHECK_VALUE(d.type() == backend, op, ": ", list.name, "[", i, "] is on ", d, ", expected a ",
                                  device_type_name(backend), " tensor");
      }
      MEGATRON_EOPT_CHECK_VALUE(d == *device, op, ": ", list.name, "[", i, "] is on ", d, " but ", first_name,
                                "[0] is on ", *device, "; all tensors must be on one device");
    }
  }
  return device;
}

bool same_dense_layout(const Tensor& a, const Tensor& b) {
  if (!non_overlapping_and_dense(aten::sizes_of(a), aten::strides_of(a)) ||
      !non_overlapping_and_dense(aten::sizes_of(b), aten::strides_of(b))) {
    return false;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// Index i of every list: the reference's shape; written tensors must not overlap themselves.
void check_index(const char* op, std::size_t i, const NamedList& reference, std::initializer_list<NamedList> lists) {
  const Tensor& ref = reference.tensors[i];
  for (const NamedList& list : lists) {
    if (list.tensors.empty()) continue;
    const Tensor& t = list.tensors[i];
    MEGATRON_EOPT_CHECK_VALUE(same_values(t.sizes(), ref.sizes()), op, ": ", list.name, "[", i, "] has shape ",
                              t.sizes(), " but ", reference.name, "[", i, "] has shape ", ref.sizes());
    MEGATRON_EOPT_CHECK_VALUE(
        !list.written || t.numel() == 0 || !has_internal_overlap(aten::sizes_of(t), aten::strides_of(t)), op, ": ",
        list.name, "[", i, "] has overlapping memory (strides ", t.strides(), ") and cannot be written in place");
  }
}

// The kernels walk the tensors of one index as flat arrays, so they need one element order. When
// every tensor of the index shares one dense layout they are used as they are; otherwise each
// non-contiguous one is replaced by a contiguous working copy (written ones are copied back).
template <typename Args>
std::vector<Tensor> working_tensors(ForeachCall<Args>& call, std::size_t i, std::initializer_list<NamedList> lists) {
  std::vector<Tensor> tensors;
  for (const NamedList& list : lists) tensors.push_back(list.tensors.empty() ? Tensor() : list.tensors[i]);
  bool shared = true;
  const Tensor& first = tensors.front();
  for (const Tensor& t : tensors) shared = shared && (!t.defined() || same_dense_layout(first, t));
  if (shared) return tensors;
  auto list = lists.begin();
  for (Tensor& t : tensors) {
    if (t.defined() && !t.is_contiguous()) {
      Tensor work = aten::contiguous(t);
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
void check_host_value(const char* op, const char* name, const StepScalar& s, DeviceType backend,
                      bool (*in_range)(double), const char* rule) {
  if (backend != kCPU || !s.present()) return;
  const double v = s.load();
  const bool ok = std::isfinite(v) && (in_range == nullptr || in_range(v));
  MEGATRON_EOPT_CHECK_VALUE(ok, op, ": ", name, " must be ", rule, ", got ", v);
}

}  // namespace

StepScalar step_scalar(const char* op, const char* name, const std::optional<Tensor>& t,
                       const std::optional<Device>& device, DeviceType backend, bool required) {
  if (!t.has_value() || !t->defined()) {
    MEGATRON_EOPT_CHECK_VALUE(!required, op, ": ", name, " must be a 0-dim float32 or float64 tensor, got None");
    return {};
  }
  MEGATRON_EOPT_CHECK_VALUE(t->dim() == 0, op, ": ", name, " must be a 0-dim float32 or float64 tensor, got shape ",
                            t->sizes());
  MEGATRON_EOPT_CHECK_TYPE(t->scalar_type() == kFloat || t->scalar_type() == kDouble, op, ": ", name,
                           " must be a 0-dim float32 or float64 tensor, got ", t->scalar_type());
  if (device) {
    MEGATRON_EOPT_CHECK_VALUE(t->device() == *device, op, ": ", name, " is on ", t->device(),
                              " but the tensor lists are on ", *device, "; pass it as a 0-dim tensor on their device");
  } else {
    MEGATRON_EOPT_CHECK_VALUE(t->device().type() == backend, op, ": ", name, " is on ", t->device(), ", expected a ",
                              device_type_name(backend), " tensor");
  }
  return StepScalar{t->const_data_ptr(), t->scalar_type() == kDouble};
}

MomentumScalars momentum_scalars(const char* op, const Tensor& momentum, const Tensor& weight_decay,
                                 const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf,
                                 const std::optional<Device>& device, DeviceType backend) {
  MomentumScalars s;
  s.momentum = step_scalar(op, "momentum", momentum, device, backend);
  s.weight_decay = step_scalar(op, "weight_decay", weight_decay, device, backend);
  s.grad_scale = step_scalar(op, "grad_scale", grad_scale, device, backend, /*required=*/false);
  s.found_inf = step_scalar(op, "found_inf", found_inf, device, backend, /*required=*/false);
  // Any finite momentum >= 0: the EMA lerp(M, g, 1 - momentum) extrapolates past 1, and
  // torch.optim.Muon accepts such values (the optimizers keep their own narrower checks).
  check_host_value(op, "momentum", s.momentum, backend, [](double v) { return v >= 0.0; }, "finite and >= 0");
  check_host_value(op, "weight_decay", s.weight_decay, backend, nullptr, "finite");
  return s;
}

ForeachCall<ForeachMomentumArgs> parse_foreach_momentum(
    const TensorList& grads, const TensorList& momentum_buffers, const TensorList& ns_inputs, const TensorList& params,
    const Tensor& momentum, bool nesterov, const Tensor& weight_decay, const std::string& weight_decay_method,
    const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf, DeviceType backend) {
  constexpr const char* op = "foreach_momentum_";
  const NamedList g{"grads", grads, false}, m{"momentum_buffers", momentum_buffers, true},
      n{"ns_inputs", ns_inputs, true}, p{"params", params, false};
  const WeightDecayMethod method = parse_method(op, weight_decay_method);
  check_length(op, m, g);
  check_length(op, n, g);
  if (method == WeightDecayMethod::kL2) {
    MEGATRON_EOPT_CHECK_VALUE(params.size() == grads.size(), op,
                              ": weight_decay_method 'l2' reads the parameters: params must have one tensor per "
                              "gradient, got ",
                              params.size(), " for ", grads.size(), " grads");
  } else if (!params.empty()) {
    check_length(op, p, g);
  }

  const auto grad_dtype = list_dtype(op, g, "grads must be float32, bfloat16 or float16", is_param_dtype);
  if (grad_dtype) {
    const ScalarType gd = *grad_dtype;
    list_dtype(op, p, "params must have the gradients' dtype", [&](ScalarType t) { return t == gd; });
    list_dtype(op, m, "momentum buffers must be float32 or the gradients' dtype",
               [&](ScalarType t) { return t == gd || t == kFloat; });
  }
  const auto ns_dtype = list_dtype(op, n, "ns_inputs must be float32 or bfloat16",
                                   [](ScalarType t) { return t == kFloat || t == kBFloat16; });
  const auto device = common_device(op, {g, m, n, p}, backend);

  ForeachCall<ForeachMomentumArgs> call;
  ForeachMomentumArgs& args = call.args;
  set_momentum_scalars(args, momentum_scalars(op, momentum, weight_decay, grad_scale, found_inf, device, backend));
  for (std::size_t i = 0; i < grads.size(); ++i) check_index(op, i, g, {m, n, p});

  args.grad_type = storage_type(grad_dtype.value_or(kFloat));
  args.buffer_type = storage_type(momentum_buffers.empty() ? kFloat : momentum_buffers[0].scalar_type());
  args.ns_type = storage_type(ns_dtype.value_or(kFloat));
  args.nesterov = nesterov;
  args.l2 = method == WeightDecayMethod::kL2;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].numel() == 0) continue;
    const std::vector<Tensor> t = args.l2 ? working_tensors(call, i, {g, m, n, p})
                                          : working_tensors(call, i, {g, m, n});
    args.grads.push_back(t[0].const_data_ptr());
    args.buffers.push_back(t[1].data_ptr());
    args.ns_inputs.push_back(t[2].data_ptr());
    if (args.l2) args.params.push_back(t[3].const_data_ptr());
    args.numels.push_back(grads[i].numel());
  }
  return call;
}

ForeachCall<ForeachUpdateArgs> parse_foreach_update(const TensorList& params, const TensorList& updates,
                                                    const std::vector<double>& scales, const Tensor& lr,
                                                    const Tensor& weight_decay, const std::string& weight_decay_method,
                                                    const std::optional<Tensor>& found_inf, DeviceType backend) {
  constexpr const char* op = "foreach_update_";
  const NamedList p{"params", params, true}, u{"updates", updates, false};
  const WeightDecayMethod method = parse_method(op, weight_decay_method);
  check_length(op, u, p);
  MEGATRON_EOPT_CHECK_VALUE(scales.size() == params.size(), op, ": scales has ", scales.size(), " values but ",
                            params.size(), " params were given");
  for (std::size_t i = 0; i < scales.size(); ++i) {
    MEGATRON_EOPT_CHECK_VALUE(std::isfinite(static_cast<float>(scales[i])), op, ": scales[", i,
                              "] must be finite in float32, got ", scales[i]);
  }
  const auto param_dtype = list_dtype(op, p, "params must be float32, bfloat16 or float16", is_param_dtype);
  if (param_dtype) {
    const ScalarType pd = *param_dtype;
    list_dtype(op, u, "updates must be float32 or the parameters' dtype",
               [&](ScalarType t) { return t == pd || t == kFloat; });
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

  args.param_type = storage_type(param_dtype.value_or(kFloat));
  args.update_type = storage_type(updates.empty() ? kFloat : updates[0].scalar_type());
  args.method = method;
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    const std::vector<Tensor> t = working_tensors(call, i, {p, u});
    args.params.push_back(t[0].data_ptr());
    args.updates.push_back(t[1].const_data_ptr());
    args.scales.push_back(static_cast<float>(scales[i]));
    args.numels.push_back(params[i].numel());
  }
  return call;
}

}  // namespace megatron_eopt
