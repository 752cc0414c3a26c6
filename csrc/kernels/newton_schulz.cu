// Batched Newton–Schulz orthogonalization on CUDA: a Frobenius-norm reduction, one fused
// normalize-and-cast pass, then three cuBLASLt GEMMs per step with the polynomial's scaled
// additions folded into their epilogues. Torch-free: raw pointers and a stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "lt_matmul.h"
#include "megatron_eopt/cuda_check.h"
#include "megatron_eopt/newton_schulz_cuda.h"
#include "megatron_eopt/ns_gemm_plan.h"
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

__global__ void bf16_to_float_kernel(const Bf16* __restrict__ in, int64_t count,
                                     float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    out[i] = to_float(in[i]);
  }
}

// Enough blocks to fill the GPU a few times over, never more than the work needs.
unsigned blocks_for(int64_t elems, int64_t matrices) {
  const int64_t wanted = (elems + kThreads - 1) / kThreads;
  const int64_t cap = std::max<int64_t>(1, 2048 / std::max<int64_t>(matrices, 1));
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, cap)));
}

std::size_t align_up(std::size_t v) { return (v + 255) / 256 * 256; }

// Norm partials of the largest grid-y slice; the slices run in stream order and share them.
int64_t partial_slots(int64_t batch, int64_t elems) {
  int64_t slots = 0;
  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = std::min(kMaxGridY, batch - first);
    slots = std::max(slots, static_cast<int64_t>(blocks_for(elems, count)) * count);
  }
  return slots;
}

}  // namespace

NsScratchLayout ns_scratch_layout(int64_t batch, int64_t m, int64_t n, bool transpose,
                                  NsPrecision precision, std::size_t blas_workspace_bytes) {
  const std::size_t elem = ns_element_bytes(precision);
  const int64_t g = transpose ? n : m;
  const std::size_t iterate_bytes = align_up(static_cast<std::size_t>(batch * m * n) * elem);
  const std::size_t gram_bytes = align_up(static_cast<std::size_t>(batch * g * g) * elem);
  NsScratchLayout layout{};
  std::size_t offset = 0;
  if (precision == NsPrecision::kMedium) {
    layout.iterate0 = offset;
    offset += iterate_bytes;
  } else {
    layout.iterate0 = SIZE_MAX;
  }
  layout.iterate1 = offset;
  offset += iterate_bytes;
  layout.gram = offset;
  offset += gram_bytes;
  layout.poly = offset;
  offset += gram_bytes;
  layout.sum_squares = offset;
  offset += align_up(static_cast<std::size_t>(batch) * sizeof(float));
  layout.norm_partials = offset;
  offset += align_up(static_cast<std::size_t>(partial_slots(batch, m * n)) * sizeof(float));
  layout.blas_workspace = offset;
  layout.total = offset + blas_workspace_bytes;
  return layout;
}

void newton_schulz_cuda(const float* x, float* out, int64_t batch, int64_t m, int64_t n,
                        bool transpose, const std::vector<NsCoefficients>& schedule, float eps,
                        NsPrecision precision, const NsScratch& scratch, int device,
                        cublasLtHandle_t handle, cudaStream_t stream) {
  const int64_t elems = m * n;
  if (batch == 0 || elems == 0) return;
  const NsGemmPlan plan = make_ns_gemm_plan(m, n, transpose);
  const std::size_t elem_bytes = ns_element_bytes(precision);

  // Start where the last step lands in iterate[0].
  int cur = static_cast<int>(schedule.size() % 2);
  void* iterate[2] = {scratch.iterate[0], scratch.iterate[1]};

  for (int64_t first = 0; first < batch; first += kMaxGridY) {
    const int64_t count = std::min(kMaxGridY, batch - first);
    const int64_t offset = first * elems;
    const dim3 grid(blocks_for(elems, count), static_cast<unsigned>(count));
    sum_squares_kernel<<<grid, kThreads, 0, stream>>>(x + offset, elems, scratch.norm_partials);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
    // With one block per matrix its partial already is the sum.
    const float* sum_squares = scratch.norm_partials;
    if (grid.x > 1) {
      reduce_partials_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
          scratch.norm_partials, grid.x, scratch.sum_squares + first);
      MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
      sum_squares = scratch.sum_squares + first;
    }
    if (precision == NsPrecision::kMedium) {
      normalize_cast_kernel<Bf16><<<grid, kThreads, 0, stream>>>(
          x + offset, elems, sum_squares, eps, static_cast<Bf16*>(iterate[cur]) + offset);
    } else {
      normalize_cast_kernel<float><<<grid, kThreads, 0, stream>>>(
          x + offset, elems, sum_squares, eps, static_cast<float*>(iterate[cur]) + offset);
    }
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  }

  for (const NsCoefficients& k : schedule) {
    void* xin = iterate[cur];
    void* xout = iterate[1 - cur];
    // G = W W^T
    lt_strided_batched_gemm({&plan.gram_gemm, batch, precision, 1.f, xin, xin, 0.f, scratch.gram,
                             scratch.gram},
                            device, handle, scratch.blas_workspace, scratch.blas_workspace_bytes, stream);
    // B = c G G + b G
    lt_strided_batched_gemm({&plan.poly_gemm, batch, precision, k.c, scratch.gram, scratch.gram, k.b,
                             scratch.gram, scratch.poly},
                            device, handle, scratch.blas_workspace, scratch.blas_workspace_bytes, stream);
    // W' = B W + a W: operand order per the plan (column-major view of row-major X).
    const void* lhs = plan.work_transposed ? scratch.poly : xin;
    const void* rhs = plan.work_transposed ? xin : scratch.poly;
    lt_strided_batched_gemm({&plan.update_gemm, batch, precision, 1.f, lhs, rhs, k.a, xin, xout}, device, handle,
                            scratch.blas_workspace, scratch.blas_workspace_bytes, stream);
    cur = 1 - cur;
  }

  const int64_t total = batch * elems;
  if (precision == NsPrecision::kMedium) {
    bf16_to_float_kernel<<<blocks_for(total, 1), kThreads, 0, stream>>>(
        static_cast<const Bf16*>(iterate[0]), total, out);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  } else if (iterate[0] != out) {
    MEGATRON_EOPT_CUDA_CHECK(
        cudaMemcpyAsync(out, iterate[0], static_cast<std::size_t>(total) * elem_bytes,
                        cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace megatron_eopt
