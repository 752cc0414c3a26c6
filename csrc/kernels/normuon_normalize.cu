// NorMuon on CUDA, two kernels per list:
//  1. slices: per slice (row when rows >= cols, else column) the sum of O^2, the EMA of its mean
//     into v and the step size; each block also writes its share of ||O||^2 and ||U'||^2
//     (U' = O * step) to a scratch slot, so no atomics and no zeroing are needed;
//  2. apply: every block sums its tensor's partials in the same order (identical norm ratio in
//     all blocks) and writes O * step(slice) * ||O|| / max(||U'||, eps).
#include <cuda_runtime.h>

#include "megatron_eopt/second_moment_cuda.h"
#include "megatron_eopt/second_moment_math.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

constexpr int kSliceThreads = 512;
constexpr int kWarps = kSliceThreads / 32;
constexpr int64_t kMaxSliceBlocksPerTensor = 512;
constexpr int kApplyThreads = 256;
constexpr int64_t kElementsPerApplyBlock = kApplyThreads * 8;
constexpr int64_t kMaxApplyBlocksPerTensor = 1024;

struct NormuonDesc {
  float* update;
  float* moment2;
  int64_t rows;
  int64_t cols;
  int64_t partials_first;  // scratch slot of the tensor's first slice block
  int64_t partials_count;  // slice blocks of the tensor
};

// The reference's rule: the state is (rows, 1), one entry per row, when rows >= cols.
__host__ __device__ __forceinline__ bool row_slices(int64_t rows, int64_t cols) { return rows >= cols; }

// Row slices: a warp per row, lanes along the contiguous row; column slices: a block handles 32
// adjacent columns at a time (coalesced rows of 128 bytes), its warps splitting the rows.
__global__ void __launch_bounds__(kSliceThreads)
    normuon_slices_kernel(const __grid_constant__ TensorListArgs<NormuonDesc> args, const Moment2Scalars scalars,
                          float2* __restrict__ partials) {
  if (step_skipped(scalars.found_inf)) return;
  const Moment2Step h = moment2_step(scalars);
  const float weight = h.weight;
  const float eps = h.eps;
  const BlockSlot slot = block_slot(args);
  const NormuonDesc d = args.tensors[slot.tensor];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  float sum_o = 0.f;  // meaningful in lane 0 of each warp (row slices) or warp 0 (column slices)
  float sum_u = 0.f;
  if (row_slices(d.rows, d.cols)) {
    for (int64_t r = slot.local * kWarps + warp; r < d.rows; r += slot.blocks * kWarps) {
      const float* row = d.update + r * d.cols;
      float acc = 0.f;
      for (int64_t c = lane; c < d.cols; c += 32) acc = fmaf(row[c], row[c], acc);
      acc = warp_sum(acc);
      if (lane == 0) {
        const float step = normuon_slice_step(d.moment2[r], acc, d.cols, weight, eps);
        sum_o += acc;
        sum_u += step * step * acc;
      }
    }
  } else {
    __shared__ float column_parts[kWarps][32];
    const int64_t tiles = (d.cols + 31) / 32;
    for (int64_t tile = slot.local; tile < tiles; tile += slot.blocks) {
      const int64_t c = tile * 32 + lane;
      float acc = 0.f;
      if (c < d.cols) {
        for (int64_t r = warp; r < d.rows; r += kWarps) {
          const float o = d.update[r * d.cols + c];
          acc = fmaf(o, o, acc);
        }
      }
      column_parts[warp][lane] = acc;
      __syncthreads();
      if (warp == 0 && c < d.cols) {
        float total = 0.f;
        for (int w = 0; w < kWarps; ++w) total += column_parts[w][lane];
        const float step = normuon_slice_step(d.moment2[c], total, d.rows, weight, eps);
        sum_o += total;
        sum_u += step * step * total;
      }
      __syncthreads();  // column_parts is rewritten by the next tile
    }
  }
  const float2 block = block_sum2(sum_o, sum_u);
  if (threadIdx.x == 0) partials[d.partials_first + slot.local] = block;
}

__global__ void __launch_bounds__(kApplyThreads)
    normuon_apply_kernel(const __grid_constant__ TensorListArgs<NormuonDesc> args, const Moment2Scalars scalars,
                         const float2* __restrict__ partials) {
  if (step_skipped(scalars.found_inf)) return;
  const float eps = moment2_step(scalars).eps;
  const BlockSlot slot = block_slot(args);
  const NormuonDesc d = args.tensors[slot.tensor];
  const float2 sums = sum_partials(partials, d.partials_first, d.partials_count);
  const float ratio = normuon_norm_ratio(sums.x, sums.y, eps);
  const bool by_row = row_slices(d.rows, d.cols);
  const int64_t numel = d.rows * d.cols;
  const int64_t stride = slot.blocks * blockDim.x;
  int64_t i = slot.local * blockDim.x + threadIdx.x;
  if (i >= numel) return;
  // (r, c) of element i, advanced by the stride without a division per element.
  int64_t r = i / d.cols;
  int64_t c = i - r * d.cols;
  const int64_t dr = stride / d.cols;
  const int64_t dc = stride - dr * d.cols;
  for (; i < numel; i += stride) {
    const float step = normuon_step_size(d.moment2[by_row ? r : c], eps);
    d.update[i] = d.update[i] * step * ratio;
    r += dr;
    c += dc;
    if (c >= d.cols) {
      c -= d.cols;
      ++r;
    }
  }
}

struct NormuonPlans {
  TensorListPlan slices;
  TensorListPlan apply;
};

NormuonPlans plan_normuon(const std::vector<Moment2Tensor>& list) {
  std::vector<int64_t> slice_work(list.size());
  std::vector<int64_t> element_work(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) {
    const int64_t rows = list[i].rows;
    const int64_t cols = list[i].cols;
    const bool empty = rows * cols == 0;  // nothing to normalize, state left as is
    // work units: rows (kWarps per block pass) or 32-column tiles (one per block pass)
    slice_work[i] = empty ? 0 : row_slices(rows, cols) ? (rows + kWarps - 1) / kWarps : (cols + 31) / 32;
    element_work[i] = rows * cols;
  }
  return {plan_tensor_list(slice_work, 1, kMaxSliceBlocksPerTensor),
          plan_tensor_list(element_work, kElementsPerApplyBlock, kMaxApplyBlocksPerTensor)};
}

}  // namespace

std::size_t normuon_scratch_floats(const std::vector<Moment2Tensor>& list) {
  return 2 * static_cast<std::size_t>(plan_normuon(list).slices.total_blocks);
}

void normuon_normalize_cuda(const std::vector<Moment2Tensor>& list, const Moment2Scalars& scalars, float* scratch,
                            cudaStream_t stream) {
  const NormuonPlans plans = plan_normuon(list);
  if (plans.slices.total_blocks == 0) return;
  auto* partials = reinterpret_cast<float2*>(scratch);
  const auto describe = [&](std::size_t i) {
    return NormuonDesc{list[i].update, list[i].moment2,
                       list[i].rows,   list[i].cols,
                       plans.slices.first_block[i], plans.slices.blocks[i]};
  };
  launch_tensor_list<NormuonDesc>(plans.slices, kSliceThreads, stream, normuon_slices_kernel, describe, scalars,
                                  partials);
  launch_tensor_list<NormuonDesc>(plans.apply, kApplyThreads, stream, normuon_apply_kernel, describe, scalars,
                                  static_cast<const float2*>(partials));
}

}  // namespace megatron_eopt
