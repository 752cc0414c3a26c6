// foreach_momentum_ on CUDA: the multi-tensor functor around momentum_element (momentum_math.h).
// momentum, weight decay, the gradient scale and found_inf are read from device memory, so the
// launch is CUDA-graph capturable and a changing momentum needs no new graph.
// Torch-free: raw pointers and a stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "megatron_eopt/foreach_cuda.h"
#include "megatron_eopt/momentum_math.h"
#include "megatron_eopt/multi_tensor_apply.cuh"

namespace megatron_eopt {
namespace {

// Lists: 0 grads, 1 momentum buffers, 2 NS inputs, 3 params (l2 only).
template <typename GradT, typename BufT, typename NsT, bool kL2>
struct MomentumOp {
  static constexpr int kDepth = kL2 ? 4 : 3;
  static constexpr int kVec = static_cast<int>(kVectorBytes / std::min({sizeof(GradT), sizeof(BufT), sizeof(NsT)}));
  // Element sizes of lists 0..kDepth-1 (the params entry is unused without l2).
  static constexpr std::size_t kElemBytes[4] = {sizeof(GradT), sizeof(BufT), sizeof(NsT), sizeof(GradT)};

  StepScalar momentum;
  StepScalar weight_decay;
  StepScalar grad_scale;
  StepScalar found_inf;
  bool nesterov;

  struct Context {
    MomentumCoefficients coefficients;
    float l2_decay;
    bool skip;
  };

  __device__ __forceinline__ Context prepare() const {
    return Context{momentum_coefficients(momentum.load(), nesterov, grad_scale.load_or(1.0)),
                   kL2 ? static_cast<float>(weight_decay.load()) : 0.f, step_skipped(found_inf)};
  }

  template <int V>
  __device__ __forceinline__ void apply(const Context& ctx, void* const (&ptrs)[kDepth], float /*scale*/,
                                        int64_t i) const {
    float g[V], m[V], p[V];
    load_elements<GradT, V>(ptrs[0], i, g);
    load_elements<BufT, V>(ptrs[1], i, m);
    if constexpr (kL2) {
      load_elements<GradT, V>(ptrs[3], i, p);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) p[k] = 0.f;
    }
    float buffer[V], ns[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const MomentumResult r = momentum_element<GradT, BufT, kL2>(g[k], p[k], ctx.l2_decay, m[k], ctx.coefficients);
      buffer[k] = r.buffer;
      ns[k] = r.ns_input;
    }
    store_elements<BufT, V>(ptrs[1], i, buffer);
    store_elements<NsT, V>(ptrs[2], i, ns);
  }
};

}  // namespace

void foreach_momentum_cuda(const ForeachMomentumArgs& args, cudaStream_t stream) {
  if (args.numels.empty()) return;
  dispatch_momentum(args, [&](auto grad_tag, auto buffer_tag, auto ns_tag, auto l2) {
    using Op = MomentumOp<typename decltype(grad_tag)::type, typename decltype(buffer_tag)::type,
                          typename decltype(ns_tag)::type, decltype(l2)::value>;
    std::vector<std::vector<void*>> pointers(args.numels.size());
    for (std::size_t t = 0; t < args.numels.size(); ++t) {
      pointers[t] = {const_cast<void*>(args.grads[t]), args.buffers[t], args.ns_inputs[t]};
      if constexpr (decltype(l2)::value) pointers[t].push_back(const_cast<void*>(args.params[t]));
    }
    const Op op{args.momentum, args.weight_decay, args.grad_scale, args.found_inf, args.nesterov};
    multi_tensor_apply(pointers, args.numels, {}, op, stream);
  });
}

}  // namespace megatron_eopt
