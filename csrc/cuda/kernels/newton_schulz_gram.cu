// The Gram Newton–Schulz program (ns_gram_plan.h) on CUDA: the normalize pass shared with the
// standard iteration, then one cuBLASLt strided-batched GEMM per product of the program (shapes
// from make_ns_gemm_plan, so the tall case is a choice of operands, never a transpose in memory)
// and two small elementwise kernels: P += a I, and Q rounded to bf16 before its products with a
// bf16 W. Torch-free: raw pointers and a stream.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "lt_matmul.h"
#include "lt_symmetric.h"
#include "megatron_eopt/cuda_check.h"
#include "megatron_eopt/newton_schulz_gram_cuda.h"
#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/storage_types.h"
#include "ns_normalize.h"

namespace megatron_eopt {
namespace {

constexpr int kThreads = 256;

unsigned elementwise_blocks(int64_t count) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((count + kThreads - 1) / kThreads, 4096)));
}

// p[b, i, i] += a for b < batch, i < side (p: side x side matrices with leading dimension ld and
// batch stride matrix_stride). Each thread owns distinct diagonal entries: no races.
__global__ void add_diagonal_kernel(float* __restrict__ p, int64_t batch, int64_t side, int64_t ld,
                                    int64_t matrix_stride, float a) {
  const int64_t count = batch * side;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < count; t += stride) {
    const int64_t b = t / side, i = t % side;
    p[b * matrix_stride + i * ld + i] += a;
  }
}

__global__ void float_to_bf16_kernel(const float* __restrict__ in, int64_t count, Bf16* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    out[i] = from_float<Bf16>(in[i]);
  }
}

LtElement element_of(const GramProgram& p, GramBuf b) {
  return gram_buf_is_bf16(p, b) ? LtElement::kBFloat16 : LtElement::kFloat32;
}

}  // namespace

int64_t ns_gram_norm_partial_slots(int64_t batch, int64_t m, int64_t n) { return ns_norm_partial_slots(batch, m * n); }

void newton_schulz_gram_cuda(const float* x, float* out, int64_t batch, int64_t m, int64_t n,
                             const GramProgram& program, float eps, const NsRecipe& recipe, NsPrecision precision,
                             void* scratch, const GramScratchLayout& layout, float* row_scales, const LtContext& blas) {
  cudaStream_t stream = blas.stream;
  if (batch == 0 || m * n == 0) return;
  const NsGemmPlan plan = make_ns_gemm_plan(m, n, program.transpose, padded_square_ld(program.gram_side));
  const int64_t side = plan.gram;
  if (side != program.gram_side) throw std::logic_error("megatron_eopt: Gram program built for another shape");

  // Buffer name -> address: kOut is the caller's output, the rest live in the scratch allocation.
  void* ptr[kGramBufCount] = {};
  for (int i = 0; i < kGramBufCount; ++i) {
    if (layout.offset[i] != kNoOffset) ptr[i] = static_cast<char*>(scratch) + layout.offset[i];
  }
  ptr[gram_buf_index(GramBuf::kOut)] = out;
  const auto at = [&ptr](GramBuf b) {
    void* p = ptr[gram_buf_index(b)];
    if (p == nullptr) throw std::logic_error("megatron_eopt: Gram program uses a buffer without storage");
    return p;
  };
  char* base = static_cast<char*>(scratch);
  // "high": TF32 products; otherwise fp32 accumulation of fp32 or bf16 operands (the s x s
  // products keep fp32 even for "medium": TF32 there lets the recursion diverge, see
  // gram_square_flop_weight).
  const LtCompute compute = precision == NsPrecision::kHigh ? LtCompute::kTf32 : LtCompute::kFp32;

  float* norm_partials = reinterpret_cast<float*>(base + layout.norm_partials);
  float* sum_squares = reinterpret_cast<float*>(base + layout.sum_squares);
  ns_normalize_cast(x, at(program.x_first), program.x_bf16, batch, m, n, eps, recipe, norm_partials, sum_squares,
                    row_scales, stream);

  // Every s x s product and W W^T are symmetric: where it pays (lt_symmetric.h), lower block
  // triangles plus a mirror. The s x s products are fp32 even under "medium": the measured default
  // keeps them full.
  const int64_t panel_width = cuda_symmetric_panel_width(side, batch, false, blas.products);

  for (const GramOp& op : program.ops) {
    switch (op.kind) {
      case GramOpKind::kAddDiag:
        add_diagonal_kernel<<<elementwise_blocks(batch * side), kThreads, 0, stream>>>(
            static_cast<float*>(at(op.d)), batch, side, plan.square_ld, plan.square_stride, op.alpha);
        MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
        break;
      case GramOpKind::kRound:  // source and destination share the padded layout: round it whole
        float_to_bf16_kernel<<<elementwise_blocks(batch * plan.square_stride), kThreads, 0, stream>>>(
            static_cast<const float*>(at(op.a)), batch * plan.square_stride, static_cast<Bf16*>(at(op.d)));
        MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
        break;
      case GramOpKind::kGemm: {
        const GemmShape* shape = op.gemm == GramGemm::kGram    ? &plan.gram_gemm
                                 : op.gemm == GramGemm::kApply ? &plan.update_gemm
                                                               : &plan.poly_gemm;
        const LtTypes types{element_of(program, op.a), element_of(program, op.d), compute};
        // beta == 0: C is not read; pass D so cuBLASLt sees a valid matrix of D's type.
        const void* c = op.beta != 0.f ? at(op.c) : at(op.d);
        const LtGemmArgs args{shape, batch, types, op.alpha, at(op.a), at(op.b), op.beta, c, at(op.d)};
        if (op.gemm == GramGemm::kApply) {
          lt_strided_batched_gemm(args, blas);
        } else {
          lt_symmetric_batched_gemm(args, panel_width, blas);
        }
        break;
      }
    }
  }
  // Muon+: the program's last product writes the fp32 result; its norm, then one pass in place.
  if (recipe.frobenius_renorm) ns_frobenius_renorm(out, false, out, batch, m, n, norm_partials, sum_squares, stream);
}

}  // namespace megatron_eopt
