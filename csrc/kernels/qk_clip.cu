// QK-clip row scaling on CUDA: each block of a launch serves one weight (tensor_list_plan.h) and
// strides over its elements; the factor of an element's row block is read from the weight's
// factor vector. Torch-free.
#include <cuda_runtime.h>

#include <algorithm>

#include "megatron_eopt/qk_clip_cuda.h"
#include "megatron_eopt/tensor_list_plan.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kElementsPerBlock = 8 * kThreads;
constexpr int64_t kMaxBlocksPerWeight = 1024;

template <typename T>
__global__ void __launch_bounds__(kThreads) qk_clip_kernel(const __grid_constant__ TensorListArgs<QkClipWeight> args) {
  const BlockSlot slot = block_slot(args);
  const QkClipWeight w = args.tensors[slot.tensor];
  T* data = static_cast<T*>(w.data);
  const int64_t count = w.rows * w.cols;
  const int64_t stride = slot.blocks * blockDim.x;
  // 64-bit element index: a weight may exceed 2^31 elements.
  for (int64_t i = slot.local * blockDim.x + threadIdx.x; i < count; i += stride) {
    const int64_t r = i / w.cols, c = i - r * w.cols;
    T& x = data[r * w.row_stride + c];
    x = qk_clip_element(x, w.factors[r / w.block_rows]);
  }
}

template <typename T>
void launch(const std::vector<QkClipWeight>& weights, cudaStream_t stream) {
  std::vector<int64_t> work;
  work.reserve(weights.size());
  for (const QkClipWeight& w : weights) work.push_back(w.rows * w.cols);
  const TensorListPlan plan = plan_tensor_list(work, kElementsPerBlock, kMaxBlocksPerWeight);
  launch_tensor_list<QkClipWeight>(plan, kThreads, stream, qk_clip_kernel<T>,
                                   [&](std::size_t i) { return weights[i]; });
}

}  // namespace

void qk_clip_cuda(const std::vector<QkClipWeight>& weights, StorageType type, cudaStream_t stream) {
  switch (type) {
    case StorageType::kFloat32: launch<float>(weights, stream); break;
    case StorageType::kBFloat16: launch<Bf16>(weights, stream); break;
    case StorageType::kFloat16: launch<Fp16>(weights, stream); break;
  }
}

}  // namespace megatron_eopt
