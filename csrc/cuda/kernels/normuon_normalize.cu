// NorMuon on CUDA, two kernels per list:
//  1. slices: per slice (row when rows >= cols, else column) the sum of the fp32-rounded squares
//     O*O, the EMA of its mean into v and the step size; then a second pass over the slice for
//     its share of ||O||^2 and of ||U'||^2 measured from the rounded U' = fl(O * step), as the CPU
//     kernel and Emerging-Optimizers 0.4 do; each block writes its shares to a scratch slot, so no
//     atomics and no zeroing are needed;
//  2. apply: every block sums its tensor's partials in the same order (identical norm ratio in
//     all blocks) and writes fl(fl(O * step(slice)) * ||O|| / max(||U'||, eps)).
#include <cuda_runtime.h>

#include "megatron_eopt/second_moment_cuda.h"
#include "megatron_eopt/second_moment_math.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

constexpr int kSliceThreads = 512;
constexpr int kWarps = kSliceThreads / 32;
constexpr int64_t kMaxSliceBlocksPerTensor = 512;

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
  float sum_o = 0.f;  // this thread's share of ||O||^2 and ||U'||^2
  float sum_u = 0.f;
  if (row_slices(d.rows, d.cols)) {
    for (int64_t r = slot.local * kWarps + warp; r < d.rows; r += slot.blocks * kWarps) {
      const float* row = d.update + r * d.cols;
      float acc = 0.f;
      for (int64_t c = lane; c < d.cols; c += 32) acc += __fmul_rn(row[c], row[c]);  // rounded squares
      acc = warp_sum(acc);
      float step = 0.f;
      if (lane == 0) step = normuon_slice_step(d.moment2[r], acc, d.cols, weight, eps);
      step = __shfl_sync(0xffffffffu, step, 0);
      for (int64_t c = lane; c < d.cols; c += 32) {
        const float u = __fmul_rn(row[c], step);
        sum_o = fmaf(row[c], row[c], sum_o);
        sum_u = fmaf(u, u, sum_u);
      }
    }
  } else {
    __shared__ float column_parts[kWarps][32];
    __shared__ float column_steps[32];
    const int64_t tiles = (d.cols + 31) / 32;
    for (int64_t tile = slot.local; tile < tiles; tile += slot.blocks) {
      const int64_t c = tile * 32 + lane;
      float acc = 0.f;
      if (c < d.cols) {
        for (int64_t r = warp; r < d.rows; r += kWarps) {
          const float o = d.update[r * d.cols + c];
          acc += __fmul_rn(o, o);  // rounded squares
        }
      }
      column_parts[warp][lane] = acc;
      __syncthreads();
      if (warp == 0 && c < d.cols) {
        float total = 0.f;
        for (int w = 0; w < kWarps; ++w) total += column_parts[w][lane];
        column_steps[lane] = normuon_slice_step(d.moment2[c], total, d.rows, weight, eps);
      }
      __syncthreads();
      if (c < d.cols) {
        const float step = column_steps[lane];
        for (int64_t r = warp; r < d.rows; r += kWarps) {
          const float o = d.update[r * d.cols + c];
          const float u = __fmul_rn(o, step);
          sum_o = fmaf(o, o, sum_o);
          sum_u = fmaf(u, u, sum_u);
        }
      }
      __syncthreads();  // column_parts and column_steps are rewritten by the next tile
    }
  }
  const float2 block = block_sum2(sum_o, sum_u);
  if (threadIdx.x == 0) partials[d.partials_first + slot.local] = block;
}

__global__ void __launch_bounds__(elementwise::kThreads)
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
    d.update[i] = __fmul_rn(__fmul_rn(d.update[i], step), ratio);  // fl(U' * ratio), U' = fl(O * step)
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
          plan_tensor_list(element_work, elementwise::kElementsPerBlock, elementwise::kMaxBlocksPerTensor)};
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
    return NormuonDesc{list[i].update,        list[i].moment2, list[i].rows, list[i].cols, plans.slices.first_block[i],
                       plans.slices.blocks[i]};
  };
  launch_tensor_list<NormuonDesc>(plans.slices, kSliceThreads, stream, normuon_slices_kernel, describe, scalars,
                                  partials);
  launch_tensor_list<NormuonDesc>(plans.apply, elementwise::kThreads, stream, normuon_apply_kernel, describe, scalars,
                                  static_cast<const float2*>(partials));
}

}  // namespace megatron_eopt
