// foreach_update_ on CUDA: the multi-tensor functor around update_element (momentum_math.h),
// cautious weight decay included (its mask reads the update and the parameter before the decay).
// lr, weight decay and found_inf are read from device memory, so the launch is CUDA-graph
// capturable. Torch-free: raw pointers and a stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "megatron_eopt/foreach_cuda.h"
#include "megatron_eopt/momentum_math.h"
#include "megatron_eopt/multi_tensor_apply.cuh"

namespace megatron_eopt {
namespace {

// Lists: 0 params, 1 updates; the table's per-tensor scalar is scales[t].
template <typename ParamT, typename UpdateT>
struct UpdateOp {
  static constexpr int kDepth = 2;
  static constexpr int kVec = static_cast<int>(kVectorBytes / std::min(sizeof(ParamT), sizeof(UpdateT)));
  static constexpr std::size_t kElemBytes[kDepth] = {sizeof(ParamT), sizeof(UpdateT)};

  WeightDecayMethod method;
  StepScalar lr;
  StepScalar weight_decay;
  StepScalar found_inf;

  struct Context {
    float lr;
    float decay;
    bool cautious;
    bool skip;
  };

  __device__ __forceinline__ Context prepare() const {
    const double l = lr.load();
    return Context{static_cast<float>(l), weight_decay_factor(method, l, weight_decay.load()),
                   method == WeightDecayMethod::kCautious, step_skipped(found_inf)};
  }

  template <int V>
  __device__ __forceinline__ void apply(const Context& ctx, void* const (&ptrs)[kDepth], float scale, int64_t i) const {
    float p[V], u[V];
    load_elements<ParamT, V>(ptrs[0], i, p);
    load_elements<UpdateT, V>(ptrs[1], i, u);
    if (ctx.cautious) {  // uniform across the launch: no divergence
#pragma unroll
      for (int k = 0; k < V; ++k) p[k] = update_element<ParamT, true>(p[k], u[k], scale, ctx.decay, ctx.lr);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) p[k] = update_element<ParamT, false>(p[k], u[k], scale, ctx.decay, ctx.lr);
    }
    store_elements<ParamT, V>(ptrs[0], i, p);
  }
};

}  // namespace

void foreach_update_cuda(const ForeachUpdateArgs& args, cudaStream_t stream) {
  if (args.numels.empty()) return;
  dispatch_update(args, [&](auto param_tag, auto update_tag) {
    using Op = UpdateOp<typename decltype(param_tag)::type, typename decltype(update_tag)::type>;
    std::vector<std::vector<void*>> pointers(args.numels.size());
    for (std::size_t t = 0; t < args.numels.size(); ++t) {
      pointers[t] = {args.params[t], const_cast<void*>(args.updates[t])};
    }
    multi_tensor_apply(pointers, args.numels, args.scales, Op{args.method, args.lr, args.weight_decay, args.found_inf},
                       stream);
  });
}

}  // namespace megatron_eopt
