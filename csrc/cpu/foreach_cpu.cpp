// foreach_momentum_ and foreach_update_ on the CPU: the same chunk plan as the CUDA launcher
// (one parallel_for task per chunk) and simple loops over momentum_element / update_element
// (momentum_math.h), so both backends compute identical values.
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cpu/cpu_clones.h"
#include "megatron_eopt/foreach_ops.h"
#include "megatron_eopt/momentum_math.h"
#include "megatron_eopt/multi_tensor_chunks.h"
#include "ops/foreach_args.h"

namespace megatron_eopt {
namespace {

// Nesterov is a template parameter here only so the compiler sees straight-line code to
// vectorize (the shared math selects between the two results at run time).
template <typename GradT, typename BufT, typename NsT, bool kL2, bool kNesterov>
MEGATRON_EOPT_CPU_CLONES void momentum_range(const GradT* grad, const GradT* param, BufT* buffer, NsT* ns_input,
                                             float l2_decay, MomentumCoefficients c, int64_t begin, int64_t end) {
  c.nesterov = kNesterov;
  for (int64_t i = begin; i < end; ++i) {
    const float p = kL2 ? to_float(param[i]) : 0.f;
    const MomentumResult r = momentum_element<GradT, BufT, kL2>(to_float(grad[i]), p, l2_decay, to_float(buffer[i]), c);
    buffer[i] = from_float<BufT>(r.buffer);
    ns_input[i] = from_float<NsT>(r.ns_input);
  }
}

// Cautious decay is a template parameter for the same reason: a straight-line loop per method.
template <typename ParamT, typename UpdateT, bool kCautious>
MEGATRON_EOPT_CPU_CLONES void update_range(ParamT* param, const UpdateT* update, float scale, float decay, float lr,
                                           int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    param[i] = from_float<ParamT>(
        update_element<ParamT, kCautious>(to_float(param[i]), to_float(update[i]), scale, decay, lr));
  }
}

// Runs body(tensor, begin, end) for every chunk of the tensors, chunks spread over the threads.
template <typename Body>
void for_each_chunk(const std::vector<int64_t>& numels, const Body& body) {
  const auto launches = plan_chunk_launches(numels, kChunkElems, std::numeric_limits<std::size_t>::max(),
                                            kMaxBlocksPerLaunch);
  for (const ChunkLaunch& launch : launches) {
    std::vector<uint32_t> first_block(launch.entries.size());
    for (std::size_t e = 0; e < launch.entries.size(); ++e) first_block[e] = launch.entries[e].first_block;
    torch::stable::parallel_for(0, launch.blocks, 1, [&](int64_t block_begin, int64_t block_end) {
      for (int64_t b = block_begin; b < block_end; ++b) {
        const auto block = static_cast<uint32_t>(b);
        const ChunkEntry& entry =
            launch.entries[locate_entry(first_block.data(), static_cast<int>(first_block.size()), block)];
        const int64_t begin = entry.begin + static_cast<int64_t>(block - entry.first_block) * kChunkElems;
        body(entry.tensor, begin, std::min(begin + kChunkElems, entry.end));
      }
    });
  }
}

void foreach_momentum_cpu(const TensorList& grads, const TensorList& momentum_buffers, const TensorList& ns_inputs,
                          const TensorList& params, const Tensor& momentum, bool nesterov, const Tensor& weight_decay,
                          const std::string& weight_decay_method, const std::optional<Tensor>& grad_scale,
                          const std::optional<Tensor>& found_inf) {
  const ForeachCall<ForeachMomentumArgs> call = parse_foreach_momentum(
      grads, momentum_buffers, ns_inputs, params, momentum, nesterov, weight_decay, weight_decay_method, grad_scale,
      found_inf, kCPU);
  const ForeachMomentumArgs& args = call.args;
  if (args.numels.empty() || step_skipped(args.found_inf)) return;
  const MomentumCoefficients coefficients = momentum_coefficients(args.momentum.load(), args.nesterov,
                                                                  args.grad_scale.load_or(1.0));
  const float l2_decay = args.l2 ? static_cast<float>(args.weight_decay.load()) : 0.f;
  dispatch_momentum(args, [&](auto grad_tag, auto buffer_tag, auto ns_tag, auto l2) {
    using G = typename decltype(grad_tag)::type;
    using B = typename decltype(buffer_tag)::type;
    using N = typename decltype(ns_tag)::type;
    constexpr bool kL2 = decltype(l2)::value;
    const auto range = coefficients.nesterov ? &momentum_range<G, B, N, kL2, true>
                                             : &momentum_range<G, B, N, kL2, false>;
    for_each_chunk(args.numels, [&](std::size_t t, int64_t begin, int64_t end) {
      range(static_cast<const G*>(args.grads[t]), kL2 ? static_cast<const G*>(args.params[t]) : nullptr,
            static_cast<B*>(args.buffers[t]), static_cast<N*>(args.ns_inputs[t]), l2_decay, coefficients, begin, end);
    });
  });
  call.finish();
}

void foreach_update_cpu(const TensorList& params, const TensorList& updates, const std::vector<double>& scales,
                        const Tensor& lr, const Tensor& weight_decay, const std::string& weight_decay_method,
                        const std::optional<Tensor>& found_inf) {
  const ForeachCall<ForeachUpdateArgs> call = parse_foreach_update(params, updates, scales, lr, weight_decay,
                                                                   weight_decay_method, found_inf, kCPU);
  const ForeachUpdateArgs& args = call.args;
  if (args.numels.empty() || step_skipped(args.found_inf)) return;
  const double lr_value = args.lr.load();
  const float decay = weight_decay_factor(args.method, lr_value, args.weight_decay.load());
  const float lr_float = static_cast<float>(lr_value);
  dispatch_update(args, [&](auto param_tag, auto update_tag) {
    using P = typename decltype(param_tag)::type;
    using U = typename decltype(update_tag)::type;
    const auto range = args.method == WeightDecayMethod::kCautious ? &update_range<P, U, true>
                                                                   : &update_range<P, U, false>;
    for_each_chunk(args.numels, [&](std::size_t t, int64_t begin, int64_t end) {
      range(static_cast<P*>(args.params[t]), static_cast<const U*>(args.updates[t]), args.scales[t], decay, lr_float,
            begin, end);
    });
  });
  call.finish();
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CPU, m) {
  m.impl("foreach_momentum_", TORCH_BOX(&foreach_momentum_cpu));
  m.impl("foreach_update_", TORCH_BOX(&foreach_update_cpu));
}

}  // namespace megatron_eopt
