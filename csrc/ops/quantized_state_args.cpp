#include "ops/quantized_state_args.h"

#include <stdexcept>
#include <string_view>

#include "ops/aten_ops.h"
#include "ops/foreach_args.h"

namespace megatron_eopt {
namespace {

constexpr ScalarType kInt8 = ScalarType::Char;
constexpr ScalarType kFloat8E4M3 = ScalarType::Float8_e4m3fn;
constexpr int64_t kMaxBlockSize = int64_t{1} << 16;

// fp8 codes of the momentum are squared, those of the second moment (sqrt(v)) linear
// (state_quantization.h).
StateFormat momentum_format(ScalarType t) {
  if (t == kBFloat16) return StateFormat::kBFloat16;
  if (t == kInt8) return StateFormat::kInt8;
  return StateFormat::kFloat8E4M3Squared;
}
StateFormat moment2_format(ScalarType t) { return t == kBFloat16 ? StateFormat::kBFloat16 : StateFormat::kFloat8E4M3; }

// All tensors of `list` share one dtype admitted by `allowed` (described by `rule`); returns it.
template <typename Allowed>
std::optional<ScalarType> one_dtype(const char* op, const char* name, const TensorList& list, const char* rule,
                                    const Allowed& allowed) {
  std::optional<ScalarType> dtype;
  for (std::size_t i = 0; i < list.size(); ++i) {
    const ScalarType t = list[i].scalar_type();
    MEGATRON_EOPT_CHECK_TYPE(allowed(t), op, ": ", name, "[", i, "] is ", t, "; ", rule);
    if (!dtype) dtype = t;
    MEGATRON_EOPT_CHECK_TYPE(t == *dtype, op, ": ", name, "[", i, "] is ", t, " but ", name, "[0] is ", *dtype,
                             "; all ", name, " must share one dtype");
  }
  return dtype;
}

void check_count(const char* op, const char* name, const TensorList& list, const char* ref_name, std::size_t n) {
  MEGATRON_EOPT_CHECK_VALUE(list.size() == n, op, ": ", name, " has ", list.size(), " tensors but ", n, " ", ref_name,
                            " were given");
}

// Every tensor on `device` (the first list's first tensor's), of the backend's type.
std::optional<Device> lists_device(const char* op,
                                   std::initializer_list<std::pair<const char*, const TensorList*>> lists,
                                   DeviceType backend) {
  std::optional<Device> device;
  const char* first = nullptr;
  for (const auto& [name, list] : lists) {
    for (std::size_t i = 0; i < list->size(); ++i) {
      const Device d = (*list)[i].device();
      if (!device) {
        device = d;
        first = name;
        MEGATRON_EOPT_CHECK_VALUE(d.type() == backend, op, ": ", name, "[", i, "] is on ", d, ", expected a ",
                                  device_type_name(backend), " tensor");
      }
      MEGATRON_EOPT_CHECK_VALUE(d == *device, op, ": ", name, "[", i, "] is on ", d, " but ", first, "[0] is on ",
                                *device, "; all tensors must be on one device");
    }
  }
  return device;
}

const int64_t* seed_pointer(const char* op, const Tensor& seed, const std::optional<Device>& device,
                            DeviceType backend) {
  MEGATRON_EOPT_CHECK_VALUE(seed.dim() == 0, op, ": seed must be a 0-dim int64 tensor, got shape ", seed.sizes());
  MEGATRON_EOPT_CHECK_TYPE(seed.scalar_type() == ScalarType::Long, op, ": seed must be a 0-dim int64 tensor, got ",
                           seed.scalar_type());
  if (device) {
    MEGATRON_EOPT_CHECK_VALUE(seed.device() == *device, op, ": seed is on ", seed.device(),
                              " but the tensor lists are on ", *device);
  } else {
    MEGATRON_EOPT_CHECK_VALUE(seed.device().type() == backend, op, ": seed is on ", seed.device(), ", expected a ",
                              device_type_name(backend), " tensor");
  }
  return static_cast<const int64_t*>(seed.const_data_ptr());
}

void check_block_size(const char* op, int64_t block_size) {
  MEGATRON_EOPT_CHECK_VALUE(block_size >= 1 && block_size <= kMaxBlockSize, op, ": block_size must be in [1, ",
                            kMaxBlockSize, "], got ", block_size);
}

// The state of index i: contiguous; its scales (formats with scales) contiguous fp32 with one
// value per block of rows of the state's last dimension.
void check_state(const char* op, const char* name, std::size_t i, const Tensor& state, const TensorList& scales,
                 StateFormat format, int64_t block_size, int64_t numel) {
  MEGATRON_EOPT_CHECK_VALUE(state.numel() == numel, op, ": ", name, "[", i, "] has ", state.numel(),
                            " elements but the tensors it belongs to have ", numel);
  MEGATRON_EOPT_CHECK_VALUE(state.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous (strides ",
                            state.strides(), ")");
  if (!has_scales(format)) return;
  const Tensor& s = scales[i];
  const int64_t row_len = state.dim() == 0 ? 1 : state.size(state.dim() - 1);
  const int64_t blocks = BlockLayout{row_len, block_size}.blocks(numel);
  MEGATRON_EOPT_CHECK_TYPE(s.scalar_type() == kFloat, op, ": scales[", i, "] must be float32, got ", s.scalar_type());
  MEGATRON_EOPT_CHECK_VALUE(s.numel() == blocks && s.is_contiguous(), op, ": scales[", i,
                            "] must be a contiguous tensor of ", blocks, " values (",
                            numel / (row_len == 0 ? 1 : row_len), " rows of ", row_len, " in blocks of ", block_size,
                            "), got shape ", s.sizes());
}

int64_t row_length(const Tensor& state) { return state.dim() == 0 ? 1 : state.size(state.dim() - 1); }

// Values per tensor in `draws`: key, local_rows, global_rows, global_cols, base (DrawIndex).
constexpr std::size_t kDrawValues = 5;

// `draws` (empty, or kDrawValues per tensor): where each tensor's elements lie in its parameter,
// checked against the state's rows so every index stays inside the parameter's matrices.
void check_draws(const char* op, const std::vector<int64_t>& draws, const TensorList& states, std::size_t n) {
  if (draws.empty()) return;
  MEGATRON_EOPT_CHECK_VALUE(draws.size() == kDrawValues * n, op, ": draws must hold ", kDrawValues,
                            " values per tensor (key, local_rows, global_rows, global_cols, base), got ", draws.size(),
                            " for ", n, " tensors");
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t* d = draws.data() + kDrawValues * i;
    const int64_t row_len = row_length(states[i]);
    const int64_t rows = row_len == 0 ? 0 : states[i].numel() / row_len;
    const bool ok = d[1] >= 1 && rows % d[1] == 0 && d[2] >= d[1] && d[3] >= row_len && d[4] >= 0;
    MEGATRON_EOPT_CHECK_VALUE(
        ok, op, ": draws of tensor ", i, " (local_rows ", d[1], ", global_rows ", d[2], ", global_cols ", d[3],
        ", base ", d[4], ") do not fit its ", rows, " rows of ", row_len,
        ": local_rows must divide the rows, global_rows >= local_rows, global_cols >= ", "the row length, base >= 0");
  }
}

// The draws of tensor i: its stream (keyed by the caller's key, or by i) and its element indices.
void set_draws(QuantizedStateTensor& t, const std::vector<int64_t>& draws, std::size_t i, uint64_t kind) {
  if (draws.empty()) {
    t.stream = draw_stream(i, kind);
    return;
  }
  const int64_t* d = draws.data() + kDrawValues * i;
  t.stream = draw_stream(static_cast<uint64_t>(d[0]), kind);
  t.draw = DrawIndex{d[1], d[2], d[3], d[4]};
}

// The state side of a kernel's tensor: codes, their block scales (when the format has them), the
// element count (the update's or grad's) and the row length the blocks follow.
void set_state(QuantizedStateTensor& t, const Tensor& state, const TensorList& scales, std::size_t i,
               StateFormat format, int64_t numel) {
  Tensor codes = state;
  t.state = codes.data_ptr();
  if (has_scales(format)) {
    Tensor s = scales[i];
    t.scales = static_cast<float*>(s.data_ptr());
  }
  t.numel = numel;
  t.row_len = row_length(state);
}

}  // namespace

QuantizedCall<QuantizedMomentumArgs> parse_foreach_momentum_quantized(
    const TensorList& grads, const TensorList& states, const TensorList& scales, const TensorList& ns_inputs,
    const TensorList& params, const Tensor& momentum, bool nesterov, const Tensor& weight_decay,
    const std::string& weight_decay_method, int64_t block_size, const Tensor& seed,
    const std::optional<Tensor>& grad_scale, const std::optional<Tensor>& found_inf, const std::vector<int64_t>& draws,
    DeviceType backend) {
  constexpr const char* op = "foreach_momentum_quantized_";
  WeightDecayMethod method;
  try {
    method = parse_weight_decay_method(std::string_view(weight_decay_method.data(), weight_decay_method.size()));
  } catch (const std::invalid_argument& e) {
    MEGATRON_EOPT_CHECK_VALUE(false, op, ": ", e.what());
  }
  const bool l2 = method == WeightDecayMethod::kL2;
  const std::size_t n = grads.size();
  check_count(op, "states", states, "grads", n);
  check_count(op, "ns_inputs", ns_inputs, "grads", n);
  if (l2) {
    MEGATRON_EOPT_CHECK_VALUE(params.size() == n, op,
                              ": weight_decay_method 'l2' reads the parameters: params must have one tensor per "
                              "gradient, got ",
                              params.size(), " for ", n, " grads");
  } else if (!params.empty()) {
    check_count(op, "params", params, "grads", n);
  }
  check_block_size(op, block_size);
  const auto grad_dtype = one_dtype(op, "grads", grads, "grads must be float32, bfloat16 or float16",
                                    [](ScalarType t) { return t == kFloat || t == kBFloat16 || t == kHalf; });
  if (grad_dtype) {
    const ScalarType gd = *grad_dtype;
    one_dtype(op, "params", params, "params must have the gradients' dtype", [&](ScalarType t) { return t == gd; });
  }
  const auto ns_dtype = one_dtype(op, "ns_inputs", ns_inputs, "ns_inputs must be float32 or bfloat16",
                                  [](ScalarType t) { return t == kFloat || t == kBFloat16; });
  const auto state_dtype = one_dtype(op, "states", states, "the momentum state must be bfloat16, int8 or float8_e4m3fn",
                                     [](ScalarType t) { return t == kBFloat16 || t == kInt8 || t == kFloat8E4M3; });
  const StateFormat format = momentum_format(state_dtype.value_or(kInt8));
  if (has_scales(format)) {
    check_count(op, "scales", scales, "grads", n);
  } else {
    MEGATRON_EOPT_CHECK_VALUE(scales.empty(), op, ": a bfloat16 state has no scales, got ", scales.size(), " tensors");
  }
  const auto device = lists_device(
      op, {{"grads", &grads}, {"states", &states}, {"scales", &scales}, {"ns_inputs", &ns_inputs}, {"params", &params}},
      backend);

  QuantizedCall<QuantizedMomentumArgs> call;
  QuantizedMomentumArgs& args = call.args;
  set_momentum_scalars(args, momentum_scalars(op, momentum, weight_decay, grad_scale, found_inf, device, backend));
  args.seed = seed_pointer(op, seed, device, backend);
  for (std::size_t i = 0; i < n; ++i) {
    const int64_t numel = grads[i].numel();
    MEGATRON_EOPT_CHECK_VALUE(ns_inputs[i].numel() == numel, op, ": ns_inputs[", i, "] has ", ns_inputs[i].numel(),
                              " elements but grads[", i, "] has ", numel);
    if (l2) {
      MEGATRON_EOPT_CHECK_VALUE(params[i].numel() == numel, op, ": params[", i, "] has ", params[i].numel(),
                                " elements but grads[", i, "] has ", numel);
    }
    check_state(op, "states", i, states[i], scales, format, block_size, numel);
  }
  check_draws(op, draws, states, n);

  args.grad_type = storage_type(grad_dtype.value_or(kFloat));
  args.ns_type = storage_type(ns_dtype.value_or(kFloat));
  args.format = format;
  args.block_size = block_size;
  args.nesterov = nesterov;
  args.l2 = l2;
  call.written.emplace(ns_inputs);
  for (std::size_t i = 0; i < n; ++i) {
    if (grads[i].numel() == 0) continue;
    // Elements pair up in row-major order; strided inputs are read through contiguous copies.
    auto input = [&](const Tensor& t) {
      if (t.is_contiguous()) return t.const_data_ptr();
      call.inputs.push_back(aten::contiguous(t));
      return call.inputs.back().const_data_ptr();
    };
    QuantizedStateTensor t;
    t.grad = input(grads[i]);
    if (l2) t.param = input(params[i]);
    t.ns_input = (*call.written)[i].data_ptr();
    set_state(t, states[i], scales, i, format, grads[i].numel());
    set_draws(t, draws, i, 0);
    args.tensors.push_back(t);
  }
  return call;
}

QuantizedCall<QuantizedMoment2Args> parse_adamuon_normalize_quantized(
    const TensorList& updates, const TensorList& moment2, const TensorList& scales, const Tensor& beta2,
    const Tensor& eps, int64_t block_size, const Tensor& seed, const std::optional<Tensor>& found_inf,
    const std::vector<int64_t>& draws, DeviceType backend) {
  constexpr const char* op = "adamuon_normalize_quantized_";
  const std::size_t n = updates.size();
  check_count(op, "moment2", moment2, "updates", n);
  check_block_size(op, block_size);
  one_dtype(op, "updates", updates, "updates must be float32", [](ScalarType t) { return t == kFloat; });
  const auto state_dtype = one_dtype(op, "moment2", moment2, "the second moment must be bfloat16 or float8_e4m3fn",
                                     [](ScalarType t) { return t == kBFloat16 || t == kFloat8E4M3; });
  const StateFormat format = moment2_format(state_dtype.value_or(kFloat8E4M3));
  if (has_scales(format)) {
    check_count(op, "scales", scales, "updates", n);
  } else {
    MEGATRON_EOPT_CHECK_VALUE(scales.empty(), op, ": a bfloat16 state has no scales, got ", scales.size(), " tensors");
  }
  const auto device = lists_device(op, {{"updates", &updates}, {"moment2", &moment2}, {"scales", &scales}}, backend);

  QuantizedCall<QuantizedMoment2Args> call;
  QuantizedMoment2Args& args = call.args;
  args.scalars = moment2_scalars(op, beta2, eps, found_inf, device, backend);
  args.seed = seed_pointer(op, seed, device, backend);
  for (std::size_t i = 0; i < n; ++i) {
    check_state(op, "moment2", i, moment2[i], scales, format, block_size, updates[i].numel());
  }
  check_draws(op, draws, moment2, n);
  args.format = format;
  args.block_size = block_size;
  call.written.emplace(updates);
  for (std::size_t i = 0; i < n; ++i) {
    if (updates[i].numel() == 0) continue;
    QuantizedStateTensor t;
    t.update = static_cast<float*>((*call.written)[i].data_ptr());
    set_state(t, moment2[i], scales, i, format, updates[i].numel());
    set_draws(t, draws, i, 1);
    args.tensors.push_back(t);
  }
  return call;
}

}  // namespace megatron_eopt
