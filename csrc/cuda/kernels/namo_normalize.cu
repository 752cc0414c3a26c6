// NAMO on CUDA, three kernels per list:
//  1. sums: each block writes its share of ||grad||^2 and ||ns_input||^2 to a scratch slot;
//  2. finalize: one block per tensor sums the partials, updates the scalar state v and stores the
//     factor ||ns_input|| / (sqrt(v) + eps) in scratch (a separate kernel, so no block reads v
//     while another writes it);
//  3. scale: O <- O * factor.
#include <cuda_runtime.h>

#include "megatron_eopt/second_moment_cuda.h"
#include "megatron_eopt/second_moment_math.h"
#include "megatron_eopt/storage_types.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

using namespace elementwise;  // kThreads, kElementsPerBlock, kMaxBlocksPerTensor

struct NamoDesc {
  float* update;
  float* moment2;
  const void* grad;
  const void* ns_input;
  int64_t numel;
  int64_t partials_first;  // scratch slot of the tensor's first sums block
  int64_t partials_count;  // sums blocks of the tensor
  int64_t factor_slot;     // scratch index of the tensor's factor
  StorageType grad_type;
  StorageType ns_input_type;
};

template <typename T>
__device__ float strided_sum_squares(const void* data, int64_t first, int64_t count, int64_t stride) {
  const T* p = static_cast<const T*>(data);
  float acc = 0.f;
  for (int64_t i = first; i < count; i += stride) {
    const float v = to_float(p[i]);
    acc = fmaf(v, v, acc);
  }
  return acc;
}

__device__ float sum_squares(const void* data, StorageType type, int64_t first, int64_t count, int64_t stride) {
  switch (type) {
    case StorageType::kBFloat16: return strided_sum_squares<Bf16>(data, first, count, stride);
    case StorageType::kFloat16: return strided_sum_squares<Fp16>(data, first, count, stride);
    case StorageType::kFloat32: break;
  }
  return strided_sum_squares<float>(data, first, count, stride);
}

__global__ void __launch_bounds__(kThreads)
    namo_sums_kernel(const __grid_constant__ TensorListArgs<NamoDesc> args, const Moment2Scalars scalars,
                     float2* __restrict__ partials) {
  if (step_skipped(scalars.found_inf)) return;
  const BlockSlot slot = block_slot(args);
  const NamoDesc d = args.tensors[slot.tensor];
  const int64_t first = slot.local * blockDim.x + threadIdx.x;
  const int64_t stride = slot.blocks * blockDim.x;
  const float g = sum_squares(d.grad, d.grad_type, first, d.numel, stride);
  const float x = sum_squares(d.ns_input, d.ns_input_type, first, d.numel, stride);
  const float2 block = block_sum2(g, x);
  if (threadIdx.x == 0) partials[d.partials_first + slot.local] = block;
}

// One block per tensor (the finalize plan gives every tensor exactly one block).
__global__ void __launch_bounds__(kThreads)
    namo_finalize_kernel(const __grid_constant__ TensorListArgs<NamoDesc> args, const Moment2Scalars scalars,
                         const float2* __restrict__ partials, float* __restrict__ factors) {
  if (step_skipped(scalars.found_inf)) return;
  const Moment2Step h = moment2_step(scalars);
  const BlockSlot slot = block_slot(args);
  const NamoDesc d = args.tensors[slot.tensor];
  const float2 sums = sum_partials(partials, d.partials_first, d.partials_count);
  if (threadIdx.x == 0) {
    const float grad_sum_sq = namo_grad_sum_sq(sums.x, scalars.grad_scale.load_or(1.0));
    factors[d.factor_slot] = namo_scale(*d.moment2, grad_sum_sq, sums.y, h.weight, h.eps);
  }
}

__global__ void __launch_bounds__(kThreads)
    namo_scale_kernel(const __grid_constant__ TensorListArgs<NamoDesc> args, const Moment2Scalars scalars,
                      const float* __restrict__ factors) {
  if (step_skipped(scalars.found_inf)) return;
  const BlockSlot slot = block_slot(args);
  const NamoDesc d = args.tensors[slot.tensor];
  const float factor = factors[d.factor_slot];
  const int64_t stride = slot.blocks * blockDim.x;
  for (int64_t i = slot.local * blockDim.x + threadIdx.x; i < d.numel; i += stride) d.update[i] *= factor;
}

struct NamoPlans {
  TensorListPlan elements;  // sums and scale passes
  TensorListPlan finalize;  // one block per tensor
};

NamoPlans plan_namo(const std::vector<Moment2Tensor>& list) {
  std::vector<int64_t> elements(list.size());
  std::vector<int64_t> one(list.size(), 1);
  for (std::size_t i = 0; i < list.size(); ++i) elements[i] = list[i].rows * list[i].cols;
  // Empty matrices get no element blocks but still a finalize block: v decays toward
  // ||grad||^2 = 0 as in the reference.
  return {plan_tensor_list(elements, kElementsPerBlock, kMaxBlocksPerTensor), plan_tensor_list(one, 1, 1)};
}

}  // namespace

std::size_t namo_scratch_floats(const std::vector<Moment2Tensor>& list) {
  const NamoPlans plans = plan_namo(list);
  return 2 * static_cast<std::size_t>(plans.elements.total_blocks) + list.size();
}

void namo_normalize_cuda(const std::vector<Moment2Tensor>& list, const Moment2Scalars& scalars, float* scratch,
                         cudaStream_t stream) {
  if (list.empty()) return;
  const NamoPlans plans = plan_namo(list);
  auto* partials = reinterpret_cast<float2*>(scratch);
  float* factors = scratch + 2 * plans.elements.total_blocks;
  const auto describe = [&](std::size_t i) {
    const Moment2Tensor& t = list[i];
    return NamoDesc{t.update,
                    t.moment2,
                    t.grad,
                    t.ns_input,
                    t.rows * t.cols,
                    plans.elements.first_block[i],
                    plans.elements.blocks[i],
                    static_cast<int64_t>(i),
                    t.grad_type,
                    t.ns_input_type};
  };
  launch_tensor_list<NamoDesc>(plans.elements, kThreads, stream, namo_sums_kernel, describe, scalars, partials);
  launch_tensor_list<NamoDesc>(plans.finalize, kThreads, stream, namo_finalize_kernel, describe, scalars,
                               static_cast<const float2*>(partials), factors);
  launch_tensor_list<NamoDesc>(plans.elements, kThreads, stream, namo_scale_kernel, describe, scalars,
                               static_cast<const float*>(factors));
}

}  // namespace megatron_eopt
