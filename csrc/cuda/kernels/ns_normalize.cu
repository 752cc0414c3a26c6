#include "ns_normalize.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

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
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sum_squares_kernel(const T* __restrict__ x, int64_t elems_per_matrix, float* __restrict__ partials) {
  const T* mat = x + static_cast<int64_t>(blockIdx.y) * elems_per_matrix;
  float acc = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems_per_matrix; i += stride) {
    const float v = to_float(mat[i]);
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

// out[b, i] = cast(x[b, i] / denominator(||x[b]||_F)): the division is in fp32, as the reference's
// F.normalize, and the cast to the compute type happens in the same pass. The default recipe's
// denominator is max(||x[b]||_F, eps) exactly.
template <typename T>
__global__ void normalize_cast_kernel(const float* __restrict__ x, int64_t elems_per_matrix,
                                      const float* __restrict__ sum_squares, float eps, float divisor,
                                      NsEpsMode eps_mode, T* __restrict__ out) {
  const int64_t base = static_cast<int64_t>(blockIdx.y) * elems_per_matrix;
  const float norm = ns_denominator(sqrtf(sum_squares[blockIdx.y]), eps, divisor, eps_mode);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems_per_matrix; i += stride) {
    out[base + i] = from_float<T>(x[base + i] / norm);
  }
}

// MuonEq, first pass: row_sums[r] = ||x_r||^2 for the `rows` rows of length n of all matrices,
// one warp per row (lanes stride the row, coalesced; a fixed shuffle tree: deterministic).
__global__ void __launch_bounds__(kThreads)
    row_sum_squares_kernel(const float* __restrict__ x, int64_t rows, int64_t n, float* __restrict__ row_sums) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
    const float* row = x + r * n;
    float acc = 0.f;
    for (int64_t k = lane; k < n; k += 32) acc = fmaf(row[k], row[k], acc);
    acc = warp_sum(acc);
    if (lane == 0) row_sums[r] = acc;
  }
}

// MuonEq, per matrix (one block each, grid.x = matrices): from its m rows' sums of squares,
// ||x||_F, the row factors f_i and the equilibrated norm ||f . x||_F; row_scales[i] becomes
// f_i / denominator(||f . x||_F), in place over the sums. Every thread reads and writes its own
// rows only, and the reads of a row happen before its write by the same thread: no races.
__global__ void __launch_bounds__(kThreads)
    row_scales_kernel(float* __restrict__ row_scales, int64_t m, float eps, float divisor, NsEpsMode eps_mode) {
  float* mine = row_scales + static_cast<int64_t>(blockIdx.x) * m;
  float total = 0.f;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) total += mine[i];
  const float frob = sqrtf(block_sum(total));
  float equilibrated = 0.f;
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    const float row_norm = sqrtf(mine[i]);
    const float scaled = muoneq_row_factor(row_norm, frob, m) * row_norm;
    equilibrated = fmaf(scaled, scaled, equilibrated);
  }
  // A second block_sum is safe: every thread has read the first one's total before it reaches
  // the barrier after this one's writes of the warp parts.
  const float denom = ns_denominator(sqrtf(block_sum(equilibrated)), eps, divisor, eps_mode);
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
    mine[i] = muoneq_row_factor(sqrtf(mine[i]), frob, m) / denom;
  }
}

// MuonEq, last pass: out[b, i, j] = cast(x[b, i, j] * row_scales[b * m + i]) (grid as
// normalize_cast_kernel).
template <typename T>
__global__ void scale_rows_cast_kernel(const float* __restrict__ x, int64_t m, int64_t n,
                                       const float* __restrict__ row_scales, T* __restrict__ out) {
  const int64_t elems_per_matrix = m * n;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * elems_per_matrix;
  const float* scales = row_scales + static_cast<int64_t>(blockIdx.y) * m;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems_per_matrix; i += stride) {
    out[base + i] = from_float<T>(x[base + i] * scales[i / n]);
  }
}

// Muon+: out[b, i] = src[b, i] * sqrt(min(m, n)) / max(||src[b]||_F, 1e-6) in fp32. Each
// element is read and written by one thread, so out may be src.
template <typename T>
__global__ void renorm_cast_kernel(const T* src, int64_t m, int64_t n, const float* __restrict__ sum_squares,
                                   float* out) {
  const int64_t elems_per_matrix = m * n;
  const int64_t base = static_cast<int64_t>(blockIdx.y) * elems_per_matrix;
  const float factor = muon_plus_factor(sqrtf(sum_squares[blockIdx.y]), m, n);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elems_per_matrix; i += stride) {
    out[base + i] = to_float(src[base + i]) * factor;
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

namespace {

// Per-matrix sums of squares of a grid-y slice of `count` matrices (partials, then their fixed-
// order sum where a matrix has several blocks); returns where they are.
template <typename T>
const float* slice_sum_squares(const T* x, int64_t elems, int64_t count, float* partials, float* sums,
                               cudaStream_t stream) {
  const dim3 grid(blocks_for(elems, count), static_cast<unsigned>(count));
  sum_squares_kernel<T><<<grid, kThreads, 0, stream>>>(x, elems, partials);
  MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  // With one block per matrix its partial already is the sum.
  if (grid.x == 1) return partials;
  reduce_partials_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(partials, grid.x, sums);
  MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  return sums;
}

template <typename T>
void launch_scale_rows(const float* x, int64_t m, int64_t n, int64_t batch, const float* row_scales, T* out,
                       cudaStream_t stream) {
  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = std::min(kMaxGridY, batch - first);
    const dim3 grid(blocks_for(m * n, count), static_cast<unsigned>(count));
    scale_rows_cast_kernel<T>
        <<<grid, kThreads, 0, stream>>>(x + first * m * n, m, n, row_scales + first * m, out + first * m * n);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

void ns_normalize_cast(const float* x, void* out, bool out_bf16, int64_t batch, int64_t m, int64_t n, float eps,
                       const NsRecipe& recipe, float* partials, float* sum_squares, float* row_scales,
                       cudaStream_t stream) {
  const int64_t elems = m * n;
  if (batch == 0 || elems == 0) return;
  if (recipe.row_equilibration) {
    // MuonEq: the row norms are the one reduction over x (||x||_F is their sum), then one pass
    // writes the scaled rows: the same traffic as the plain normalization.
    const int64_t rows = batch * m;
    const int64_t warps_per_block = kThreads / 32;
    const unsigned blocks = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>((rows + warps_per_block - 1) / warps_per_block, 4096)));
    row_sum_squares_kernel<<<blocks, kThreads, 0, stream>>>(x, rows, n, row_scales);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
    for (int64_t first = 0; first < batch; first += std::numeric_limits<int32_t>::max()) {
      const int64_t count = std::min<int64_t>(std::numeric_limits<int32_t>::max(), batch - first);
      row_scales_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(row_scales + first * m, m, eps,
                                                                               recipe.norm_divisor, recipe.eps_mode);
      MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
    }
    if (out_bf16) launch_scale_rows(x, m, n, batch, row_scales, static_cast<Bf16*>(out), stream);
    else launch_scale_rows(x, m, n, batch, row_scales, static_cast<float*>(out), stream);
    return;
  }
  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = std::min(kMaxGridY, batch - first);
    const int64_t offset = first * elems;
    const float* sums = slice_sum_squares(x + offset, elems, count, partials, sum_squares + first, stream);
    const dim3 grid(blocks_for(elems, count), static_cast<unsigned>(count));
    if (out_bf16) {
      normalize_cast_kernel<Bf16><<<grid, kThreads, 0, stream>>>(x + offset, elems, sums, eps, recipe.norm_divisor,
                                                                 recipe.eps_mode, static_cast<Bf16*>(out) + offset);
    } else {
      normalize_cast_kernel<float><<<grid, kThreads, 0, stream>>>(x + offset, elems, sums, eps, recipe.norm_divisor,
                                                                  recipe.eps_mode, static_cast<float*>(out) + offset);
    }
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  }
}

void ns_frobenius_renorm(const void* src, bool src_bf16, float* out, int64_t batch, int64_t m, int64_t n,
                         float* partials, float* sum_squares, cudaStream_t stream) {
  const int64_t elems = m * n;
  if (batch == 0 || elems == 0) return;
  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = std::min(kMaxGridY, batch - first);
    const int64_t offset = first * elems;
    const dim3 grid(blocks_for(elems, count), static_cast<unsigned>(count));
    if (src_bf16) {
      const Bf16* s = static_cast<const Bf16*>(src) + offset;
      const float* sums = slice_sum_squares(s, elems, count, partials, sum_squares + first, stream);
      renorm_cast_kernel<Bf16><<<grid, kThreads, 0, stream>>>(s, m, n, sums, out + offset);
    } else {
      const float* s = static_cast<const float*>(src) + offset;
      const float* sums = slice_sum_squares(s, elems, count, partials, sum_squares + first, stream);
      renorm_cast_kernel<float><<<grid, kThreads, 0, stream>>>(s, m, n, sums, out + offset);
    }
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace megatron_eopt
