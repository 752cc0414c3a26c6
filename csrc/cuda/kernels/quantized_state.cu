// The low-memory state ops on CUDA. One warp per block of the state (a block lies within one row,
// block_size values): pass 1 steps every value in fp32 and reduces the block's absmax across the
// warp; pass 2 steps the values again (the same inputs, so the same results: nothing is written
// before pass 2), writes the fp32 outputs and stores the state with its new scale. Recomputing
// costs a second read of the block's inputs, from L1/L2, instead of registers sized for the
// largest block, so any block_size works with one kernel per type combination.
// Torch-free: raw pointers and a stream.
#include <cuda_runtime.h>

#include <cstdint>

#include "megatron_eopt/quantized_state_cuda.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocksPerTensor = 4096;

struct MomentumKernelScalars {
  StepScalar momentum;
  StepScalar weight_decay;
  StepScalar grad_scale;
  StepScalar found_inf;
  const int64_t* seed;
  int64_t block_size;
  bool nesterov;
};

struct Moment2KernelScalars {
  Moment2Scalars scalars;
  const int64_t* seed;
  int64_t block_size;
};

// The largest |value| of the warp's lanes, NaN when any lane holds NaN; every lane gets it.
__device__ __forceinline__ float warp_absmax(float a) {
  for (int offset = 16; offset > 0; offset >>= 1) a = absmax_update(a, __shfl_xor_sync(0xffffffffu, a, offset));
  return a;
}

// Calls body(tensor, block, begin, end) for each state block this warp owns. All lanes of a warp
// visit the same blocks (the loop bounds are warp-uniform), so the shuffles inside body are safe.
template <typename Body>
__device__ __forceinline__ void for_warp_blocks(const TensorListArgs<QuantizedStateTensor>& args, int64_t block_size,
                                                const Body& body) {
  const BlockSlot slot = block_slot(args);
  const QuantizedStateTensor& d = args.tensors[slot.tensor];
  const BlockLayout layout{d.row_len, block_size};
  const int64_t blocks = layout.blocks(d.numel);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  for (int64_t b = slot.local * kWarps + warp; b < blocks; b += slot.blocks * kWarps) {
    int64_t begin, end;
    layout.range(b, begin, end);
    body(d, b, begin, end);
  }
}

template <typename GradT, typename NsT, bool kL2, StateFormat F>
__global__ void __launch_bounds__(kThreads)
    momentum_quantized_kernel(const __grid_constant__ TensorListArgs<QuantizedStateTensor> args,
                              const MomentumKernelScalars s) {
  if (step_skipped(s.found_inf)) return;
  const MomentumCoefficients c = momentum_coefficients(s.momentum.load(), s.nesterov, s.grad_scale.load_or(1.0));
  const float l2_decay = kL2 ? static_cast<float>(s.weight_decay.load()) : 0.f;
  const auto seed = static_cast<uint64_t>(*s.seed);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for_warp_blocks(args, s.block_size, [&](const QuantizedStateTensor& d, int64_t b, int64_t begin, int64_t end) {
    const QuantizedMomentumElement<GradT, kL2> element{static_cast<const GradT*>(d.grad),
                                                       static_cast<const GradT*>(d.param), l2_decay, c};
    const float old_scale = has_scales(F) ? d.scales[b] : 0.f;
    float absmax = 0.f;
    for (int64_t i = begin + lane; i < end; i += 32) {
      absmax = absmax_update(absmax, element(i, load_state<F>(d.state, i, old_scale)).buffer);
    }
    const BlockScale scale = has_scales(F) ? block_scale(warp_absmax(absmax), F) : BlockScale{0.f, 0.f};
    NsT* ns = static_cast<NsT*>(d.ns_input);
    const uint64_t key = draw_key(seed, d.stream);
    const uint64_t first_draw = d.draw.of(begin, d.row_len);  // the block lies in one row: consecutive indices
    for (int64_t i = begin + lane; i < end; i += 32) {
      const MomentumResult r = element(i, load_state<F>(d.state, i, old_scale));
      ns[i] = from_float<NsT>(r.ns_input);
      store_state<F>(d.state, i, r.buffer, scale.inverse,
                     element_bits(key, first_draw + static_cast<uint64_t>(i - begin)));
    }
    // Every lane read the old scale before the shuffles above, so it can be replaced now.
    if (has_scales(F) && lane == 0) d.scales[b] = scale.scale;
  });
}

template <StateFormat F>
__global__ void __launch_bounds__(kThreads)
    adamuon_quantized_kernel(const __grid_constant__ TensorListArgs<QuantizedStateTensor> args,
                             const Moment2KernelScalars s) {
  if (step_skipped(s.scalars.found_inf)) return;
  const Moment2Step h = moment2_step(s.scalars);
  const auto seed = static_cast<uint64_t>(*s.seed);
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for_warp_blocks(args, s.block_size, [&](const QuantizedStateTensor& d, int64_t b, int64_t begin, int64_t end) {
    const float old_scale = has_scales(F) ? d.scales[b] : 0.f;
    float absmax = 0.f;
    for (int64_t i = begin + lane; i < end; i += 32) {
      float v = moment2_from_stored<F>(load_state<F>(d.state, i, old_scale));
      (void)adamuon_normalize(d.update[i], v, h.weight, h.eps);
      absmax = absmax_update(absmax, moment2_stored<F>(v));
    }
    const BlockScale scale = has_scales(F) ? block_scale(warp_absmax(absmax), F) : BlockScale{0.f, 0.f};
    const uint64_t key = draw_key(seed, d.stream);
    const uint64_t first_draw = d.draw.of(begin, d.row_len);
    for (int64_t i = begin + lane; i < end; i += 32) {
      float v = moment2_from_stored<F>(load_state<F>(d.state, i, old_scale));
      d.update[i] = adamuon_normalize(d.update[i], v, h.weight, h.eps);
      store_state<F>(d.state, i, moment2_stored<F>(v), scale.inverse,
                     element_bits(key, first_draw + static_cast<uint64_t>(i - begin)));
    }
    if (has_scales(F) && lane == 0) d.scales[b] = scale.scale;
  });
}

TensorListPlan plan_blocks(const std::vector<QuantizedStateTensor>& tensors, int64_t block_size) {
  std::vector<int64_t> work(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    work[i] = BlockLayout{tensors[i].row_len, block_size}.blocks(tensors[i].numel);
  }
  return plan_tensor_list(work, kWarps, kMaxBlocksPerTensor);
}

}  // namespace

void foreach_momentum_quantized_cuda(const QuantizedMomentumArgs& args, cudaStream_t stream) {
  if (args.tensors.empty()) return;
  const TensorListPlan plan = plan_blocks(args.tensors, args.block_size);
  const MomentumKernelScalars scalars{args.momentum, args.weight_decay, args.grad_scale, args.found_inf,
                                      args.seed,     args.block_size,   args.nesterov};
  dispatch_quantized_momentum(args, [&](auto grad_tag, auto ns_tag, auto l2, auto format) {
    using G = typename decltype(grad_tag)::type;
    using N = typename decltype(ns_tag)::type;
    launch_tensor_list<QuantizedStateTensor>(
        plan, kThreads, stream, momentum_quantized_kernel<G, N, decltype(l2)::value, decltype(format)::value>,
        [&](std::size_t i) { return args.tensors[i]; }, scalars);
  });
}

void adamuon_normalize_quantized_cuda(const QuantizedMoment2Args& args, cudaStream_t stream) {
  if (args.tensors.empty()) return;
  const TensorListPlan plan = plan_blocks(args.tensors, args.block_size);
  const Moment2KernelScalars scalars{args.scalars, args.seed, args.block_size};
  dispatch_quantized_moment2(args, [&](auto format) {
    launch_tensor_list<QuantizedStateTensor>(
        plan, kThreads, stream, adamuon_quantized_kernel<decltype(format)::value>,
        [&](std::size_t i) { return args.tensors[i]; }, scalars);
  });
}

}  // namespace megatron_eopt
