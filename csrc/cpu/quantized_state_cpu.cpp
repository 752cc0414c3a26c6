// The low-memory state ops on the CPU: one parallel_for over the blocks of every tensor; per
// block, the fp32 step into a small buffer with its absmax, then the stochastic rounding into the
// state format. The element math is the one the CUDA kernels run (quantized_state_ops.h).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cpu/cpu_clones.h"
#include "megatron_eopt/quantized_state_ops.h"
#include "ops/quantized_state_args.h"

// The loops below write one array and read others that never overlap it (the op's checks), but
// int8 / bf16 stores may alias anything as far as the compiler knows: MEGATRON_EOPT_NO_ALIAS.

namespace megatron_eopt {
namespace {

// Blocks of every tensor of a list, numbered consecutively: the parallel_for range.
struct BlockIndex {
  std::vector<int64_t> first;  // per tensor, plus the total at the end

  explicit BlockIndex(const std::vector<QuantizedStateTensor>& tensors, int64_t block_size) {
    first.push_back(0);
    for (const QuantizedStateTensor& t : tensors) {
      first.push_back(first.back() + BlockLayout{t.row_len, block_size}.blocks(t.numel));
    }
  }
  int64_t total() const { return first.back(); }
  // The tensor holding global block b (first[t] <= b < first[t + 1]).
  std::size_t tensor_of(int64_t b) const {
    std::size_t lo = 0, hi = first.size() - 2;
    while (lo < hi) {
      const std::size_t mid = (lo + hi + 1) / 2;
      if (first[mid] <= b) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }
};

// Runs body(tensor, block, begin, end) for every block, spread over the threads; `grain` blocks
// per task at least, so tasks hold a few thousand elements.
template <typename Body>
void for_each_block(const std::vector<QuantizedStateTensor>& tensors, int64_t block_size, const Body& body) {
  const BlockIndex index(tensors, block_size);
  const int64_t grain = std::max<int64_t>(1, 4096 / block_size);
  torch::stable::parallel_for(0, index.total(), grain, [&](int64_t first, int64_t last) {
    std::size_t t = index.tensor_of(first);
    for (int64_t b = first; b < last; ++b) {
      while (b >= index.first[t + 1]) ++t;
      const QuantizedStateTensor& tensor = tensors[t];
      int64_t begin, end;
      BlockLayout{tensor.row_len, block_size}.range(b - index.first[t], begin, end);
      body(tensor, b - index.first[t], begin, end);
    }
  });
}

// The block's absmax (NaN-propagating, see absmax_key) over its fp32 values.
MEGATRON_EOPT_CPU_CLONES float block_absmax(const float* values, int64_t n) {
  uint32_t key = 0;
  MEGATRON_EOPT_NO_ALIAS
  for (int64_t j = 0; j < n; ++j) key = absmax_key_update(key, values[j]);
  return absmax_from_key(key);
}

// Stores a block's fp32 values in format F with its new scale (the scale written by the caller).
// Element begin + j draws at index first_draw + j of its parameter (DrawIndex: a block lies in one row).
template <StateFormat F>
MEGATRON_EOPT_CPU_CLONES void store_block(void* state, int64_t begin, int64_t n, const float* values, float inverse,
                                          uint64_t key, uint64_t first_draw) {
  MEGATRON_EOPT_NO_ALIAS
  for (int64_t j = 0; j < n; ++j) {
    store_state<F>(state, begin + j, values[j], inverse, element_bits(key, first_draw + static_cast<uint64_t>(j)));
  }
}

// Simple loops per block (decode, step, absmax, store) rather than one: each vectorizes.
template <typename GradT, typename NsT, bool kL2, StateFormat F>
MEGATRON_EOPT_CPU_CLONES void momentum_block(const QuantizedStateTensor& t, int64_t block, int64_t begin, int64_t end,
                                             float l2_decay, const MomentumCoefficients& c, uint64_t seed,
                                             float* values) {
  const QuantizedMomentumElement<GradT, kL2> element{static_cast<const GradT*>(t.grad),
                                                     static_cast<const GradT*>(t.param), l2_decay, c};
  NsT* ns = static_cast<NsT*>(t.ns_input);
  const float old_scale = has_scales(F) ? t.scales[block] : 0.f;
  // The old state is decoded in a loop of its own: GCC does not vectorize fp8's square root and
  // the step in one loop.
  MEGATRON_EOPT_NO_ALIAS
  for (int64_t i = begin; i < end; ++i) values[i - begin] = load_state<F>(t.state, i, old_scale);
  MEGATRON_EOPT_NO_ALIAS
  for (int64_t i = begin; i < end; ++i) {
    const MomentumResult r = element(i, values[i - begin]);
    ns[i] = from_float<NsT>(r.ns_input);
    values[i - begin] = r.buffer;
  }
  BlockScale s{0.f, 0.f};
  if constexpr (has_scales(F)) {
    s = block_scale(block_absmax(values, end - begin), F);
    t.scales[block] = s.scale;
  }
  store_block<F>(t.state, begin, end - begin, values, s.inverse, draw_key(seed, t.stream), t.draw.of(begin, t.row_len));
}

template <StateFormat F>
MEGATRON_EOPT_CPU_CLONES void moment2_block(const QuantizedStateTensor& t, int64_t block, int64_t begin, int64_t end,
                                            const Moment2Step& h, uint64_t seed, float* values) {
  const float old_scale = has_scales(F) ? t.scales[block] : 0.f;
  MEGATRON_EOPT_NO_ALIAS
  for (int64_t i = begin; i < end; ++i) {
    float v = moment2_from_stored<F>(load_state<F>(t.state, i, old_scale));
    t.update[i] = adamuon_normalize(t.update[i], v, h.weight, h.eps);
    values[i - begin] = moment2_stored<F>(v);
  }
  BlockScale s{0.f, 0.f};
  if constexpr (has_scales(F)) {
    s = block_scale(block_absmax(values, end - begin), F);
    t.scales[block] = s.scale;
  }
  store_block<F>(t.state, begin, end - begin, values, s.inverse, draw_key(seed, t.stream), t.draw.of(begin, t.row_len));
}

void foreach_momentum_quantized_cpu(const TensorList& grads, const TensorList& states, const TensorList& scales,
                                    const TensorList& ns_inputs, const TensorList& params, const Tensor& momentum,
                                    bool nesterov, const Tensor& weight_decay, const std::string& weight_decay_method,
                                    int64_t block_size, const Tensor& seed, const std::optional<Tensor>& grad_scale,
                                    const std::optional<Tensor>& found_inf, const std::vector<int64_t>& draws) {
  const auto call = parse_foreach_momentum_quantized(grads, states, scales, ns_inputs, params, momentum, nesterov,
                                                     weight_decay, weight_decay_method, block_size, seed, grad_scale,
                                                     found_inf, draws, kCPU);
  const QuantizedMomentumArgs& args = call.args;
  if (args.tensors.empty() || step_skipped(args.found_inf)) return;
  const MomentumCoefficients c = momentum_coefficients(args.momentum.load(), args.nesterov,
                                                       args.grad_scale.load_or(1.0));
  const float l2_decay = args.l2 ? static_cast<float>(args.weight_decay.load()) : 0.f;
  const auto step_seed = static_cast<uint64_t>(*args.seed);
  dispatch_quantized_momentum(args, [&](auto grad_tag, auto ns_tag, auto l2, auto format) {
    using G = typename decltype(grad_tag)::type;
    using N = typename decltype(ns_tag)::type;
    for_each_block(args.tensors, args.block_size,
                   [&](const QuantizedStateTensor& t, int64_t b, int64_t begin, int64_t end) {
                     thread_local std::vector<float> values;
                     if (values.size() < static_cast<std::size_t>(args.block_size)) values.resize(args.block_size);
                     momentum_block<G, N, decltype(l2)::value, decltype(format)::value>(t, b, begin, end, l2_decay, c,
                                                                                        step_seed, values.data());
                   });
  });
  call.finish();
}

void adamuon_normalize_quantized_cpu(const TensorList& updates, const TensorList& moment2, const TensorList& scales,
                                     const Tensor& beta2, const Tensor& eps, int64_t block_size, const Tensor& seed,
                                     const std::optional<Tensor>& found_inf, const std::vector<int64_t>& draws) {
  const auto call = parse_adamuon_normalize_quantized(updates, moment2, scales, beta2, eps, block_size, seed, found_inf,
                                                      draws, kCPU);
  const QuantizedMoment2Args& args = call.args;
  if (args.tensors.empty() || step_skipped(args.scalars.found_inf)) return;
  const Moment2Step h = moment2_step(args.scalars);
  const auto step_seed = static_cast<uint64_t>(*args.seed);
  dispatch_quantized_moment2(args, [&](auto format) {
    for_each_block(args.tensors, args.block_size,
                   [&](const QuantizedStateTensor& t, int64_t b, int64_t begin, int64_t end) {
                     thread_local std::vector<float> values;
                     if (values.size() < static_cast<std::size_t>(args.block_size)) values.resize(args.block_size);
                     moment2_block<decltype(format)::value>(t, b, begin, end, h, step_seed, values.data());
                   });
  });
  call.finish();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CPU, m) {
  m.impl("foreach_momentum_quantized_", TORCH_BOX(&foreach_momentum_quantized_cpu));
  m.impl("adamuon_normalize_quantized_", TORCH_BOX(&adamuon_normalize_quantized_cpu));
}

}  // namespace megatron_eopt
