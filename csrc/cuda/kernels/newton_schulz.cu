// Batched Newton–Schulz orthogonalization on CUDA (the standard iteration, docs/design.md §4.1): a Frobenius-norm
// reduction and one fused normalize-and-cast pass (ns_normalize.cu), then three cuBLASLt GEMMs
// per step with the polynomial's scaled additions folded into their epilogues. Torch-free: raw
// pointers and a stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "lt_matmul.h"
#include "lt_symmetric.h"
#include "ns_normalize.h"
#include "megatron_eopt/cuda_check.h"
#include "megatron_eopt/newton_schulz_cuda.h"
#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {
namespace {

constexpr int kThreads = 256;

__global__ void bf16_to_float_kernel(const Bf16* __restrict__ in, int64_t count, float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    out[i] = to_float(in[i]);
  }
}

unsigned elementwise_blocks(int64_t count) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((count + kThreads - 1) / kThreads, 2048)));
}

}  // namespace

NsScratchLayout ns_cuda_scratch_layout(int64_t batch, int64_t m, int64_t n, bool transpose, NsPrecision precision,
                                       bool result_over_input) {
  return ns_scratch_layout(batch, m, n, transpose, precision, ns_norm_partial_slots(batch, m * n), result_over_input);
}

void newton_schulz_cuda(const float* x, float* out, int64_t batch, int64_t m, int64_t n, bool transpose,
                        const std::vector<NsCoefficients>& schedule, float eps, const NsRecipe& recipe,
                        NsPrecision precision, const NsScratch& scratch, const LtContext& blas) {
  cudaStream_t stream = blas.stream;
  const int64_t elems = m * n;
  if (batch == 0 || elems == 0) return;
  const NsGemmPlan plan = make_ns_gemm_plan(m, n, transpose, padded_square_ld(transpose ? n : m));
  const std::size_t elem_bytes = ns_element_bytes(precision);
  const LtTypes types = lt_types(precision);

  // G and B are symmetric: where it pays (lt_symmetric.h), their lower block triangles plus a mirror.
  const int64_t panel_width = cuda_symmetric_panel_width(plan.gram, batch, precision == NsPrecision::kMedium,
                                                         blas.products);

  // Start where the last step lands in iterate[0].
  int cur = static_cast<int>(schedule.size() % 2);
  void* iterate[2] = {scratch.iterate[0], scratch.iterate[1]};
  ns_normalize_cast(x, iterate[cur], precision == NsPrecision::kMedium, batch, m, n, eps, recipe, scratch.norm_partials,
                    scratch.sum_squares, scratch.row_scales, stream);

  for (const NsCoefficients& k : schedule) {
    void* xin = iterate[cur];
    void* xout = iterate[1 - cur];
    // G = W W^T
    lt_symmetric_batched_gemm({&plan.gram_gemm, batch, types, 1.f, xin, xin, 0.f, scratch.gram, scratch.gram},
                              panel_width, blas);
    // B = c G G + b G
    lt_symmetric_batched_gemm(
        {&plan.poly_gemm, batch, types, k.c, scratch.gram, scratch.gram, k.b, scratch.gram, scratch.poly}, panel_width,
        blas);
    // W' = B W + a W: operand order per the plan (column-major view of row-major X).
    const void* lhs = plan.work_transposed ? scratch.poly : xin;
    const void* rhs = plan.work_transposed ? xin : scratch.poly;
    lt_strided_batched_gemm({&plan.update_gemm, batch, types, 1.f, lhs, rhs, k.a, xin, xout}, blas);
    cur = 1 - cur;
  }

  const int64_t total = batch * elems;
  if (recipe.frobenius_renorm) {
    // Muon+ in the pass that writes the fp32 result: a reduction over the last iterate (bf16 under
    // "medium"), then one read of it and one write of `out` (in place when it already is out).
    ns_frobenius_renorm(iterate[0], precision == NsPrecision::kMedium, out, batch, m, n, scratch.norm_partials,
                        scratch.sum_squares, stream);
  } else if (precision == NsPrecision::kMedium) {
    bf16_to_float_kernel<<<elementwise_blocks(total), kThreads, 0, stream>>>(static_cast<const Bf16*>(iterate[0]),
                                                                             total, out);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  } else if (iterate[0] != out) {
    MEGATRON_EOPT_CUDA_CHECK(cudaMemcpyAsync(out, iterate[0], static_cast<std::size_t>(total) * elem_bytes,
                                             cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace megatron_eopt
