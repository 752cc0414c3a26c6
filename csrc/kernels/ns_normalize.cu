#include "ns_normalize.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "megatron_eopt/cuda_check.h"
#include "megatron_eopt/storage_types.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

constexpr int kThreads = 256;
// grid.y indexes the matrix; it is capped at 65535, so very large batches go in slices.
constexpr int64_t kMaxGridY = 65535;

// partials[b * gridDim.x + blockIdx.x] = sum of x[b, i]^2 over this block's slice of matrix b
// (grid.y = batch). Each block writes its own slot, so no atomics: results are run-to-run identical.
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const float* __restrict__ x, int64_t elems_per_matrix, float* __restrict__ partials) {
  const float* mat = x + static_cast<int64_t>(blockIdx.y) * elems_per_matrix;
  float acc = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems_per_matrix;
       i += stride) {
    const float v = mat[i];
    acc = fmaf(v, v, acc);
  }
  const float block = block_sum(acc);
  if (threadIdx.x == 0) partials[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = block;
}

// sum_squares[b] = sum of the `blocks_per_matrix` partials of matrix b, in a fixed order
// (one block per matrix).
__global__ void __launch_bounds__(kThreads)
    reduce_partials_kernel(const float* __restrict__ partials, int64_t blocks_per_matrix,
                           float* __restrict__ sum_squares) {
  const float* mine = partials + static_cast<int64_t>(blockIdx.x) * blocks_per_matrix;
  float acc = 0.f;
  for (int64_t j = threadIdx.x; j < blocks_per_matrix; j += blockDim.x) acc += mine[j];
  const float total = block_sum(acc);
  if (threadIdx.x == 0) sum_squares[blockIdx.x] = total;
}

// out[b, i] = cast(x[b, i] / max(||x[b]||_F, eps)): the division is in fp32, as the reference's
// F.normalize, and the cast to the compute type happens in the same pass.
template <typename T>
__global__ void normalize_cast_kernel(const float* __restrict__ x, int64_t elems_per_matrix,
                                      const float* __restrict__ sum_squares, float eps,
                                      T* __restrict__ out) {
  const int64_t base = static_cast<int64_t>(blockIdx.y) * elems_per_matrix;
  const float norm = fmaxf(sqrtf(sum_squares[blockIdx.y]), eps);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems_per_matrix;
       i += stride) {
    out[base + i] = from_float<T>(x[base + i] / norm);
  }
}

// Enough blocks to fill the GPU a few times over, never more than the work needs.
unsigned blocks_for(int64_t elems, int64_t matrices) {
  const int64_t wanted = (elems + kThreads - 1) / kThreads;
  const int64_t cap = std::max<int64_t>(1, 2048 / std::max<int64_t>(matrices, 1));
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, cap)));
}

}  // namespace

// Norm partials of the largest grid-y slice; the slices run in stream order and share them.
int64_t ns_norm_partial_slots(int64_t batch, int64_t elems) {
  int64_t slots = 0;
  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = std::min(kMaxGridY, batch - first);
    slots = std::max(slots, static_cast<int64_t>(blocks_for(elems, count)) * count);
  }
  return slots;
}

void ns_normalize_cast(const float* x, void* out, bool out_bf16, int64_t batch, int64_t elems, float eps,
                       float* partials, float* sum_squares, cudaStream_t stream) {
  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = std::min(kMaxGridY, batch - first);
    const int64_t offset = first * elems;
    const dim3 grid(blocks_for(elems, count), static_cast<unsigned>(count));
    sum_squares_kernel<<<grid, kThreads, 0, stream>>>(x + offset, elems, partials);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
    // With one block per matrix its partial already is the sum.
    const float* sums = partials;
    if (grid.x > 1) {
      reduce_partials_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(partials, grid.x,
                                                                                    sum_squares + first);
      MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
      sums = sum_squares + first;
    }
    if (out_bf16) {
      normalize_cast_kernel<Bf16><<<grid, kThreads, 0, stream>>>(x + offset, elems, sums, eps,
                                                                 static_cast<Bf16*>(out) + offset);
    } else {
      normalize_cast_kernel<float><<<grid, kThreads, 0, stream>>>(x + offset, elems, sums, eps,
                                                                  static_cast<float*>(out) + offset);
    }
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace megatron_eopt
