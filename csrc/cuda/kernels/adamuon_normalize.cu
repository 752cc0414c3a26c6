// AdaMuon on CUDA: one elementwise pass over every (update, moment2) pair of the list.
#include <cuda_runtime.h>

#include "megatron_eopt/second_moment_cuda.h"
#include "megatron_eopt/second_moment_math.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

using namespace elementwise;  // kThreads, kElementsPerBlock, kMaxBlocksPerTensor

struct AdamuonDesc {
  float* update;
  float* moment2;
  int64_t numel;
};

__global__ void __launch_bounds__(kThreads)
    adamuon_kernel(const __grid_constant__ TensorListArgs<AdamuonDesc> args, const Moment2Scalars scalars) {
  if (step_skipped(scalars.found_inf)) return;
  const Moment2Step h = moment2_step(scalars);
  const BlockSlot slot = block_slot(args);
  const AdamuonDesc d = args.tensors[slot.tensor];
  const int64_t stride = slot.blocks * blockDim.x;
  for (int64_t i = slot.local * blockDim.x + threadIdx.x; i < d.numel; i += stride) {
    float v = d.moment2[i];
    d.update[i] = adamuon_normalize(d.update[i], v, h.weight, h.eps);
    d.moment2[i] = v;
  }
}

}  // namespace

void adamuon_normalize_cuda(const std::vector<Moment2Tensor>& list, const Moment2Scalars& scalars,
                            cudaStream_t stream) {
  std::vector<int64_t> work(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) work[i] = list[i].rows * list[i].cols;
  const TensorListPlan plan = plan_tensor_list(work, kElementsPerBlock, kMaxBlocksPerTensor);
  launch_tensor_list<AdamuonDesc>(
      plan, kThreads, stream, adamuon_kernel,
      [&](std::size_t i) { return AdamuonDesc{list[i].update, list[i].moment2, work[i]}; }, scalars);
}

}  // namespace megatron_eopt
