// Gram Newton–Schulz on the CPU: runs a GramProgram (megatron_eopt/ns_gram_plan.h) with ATen's
// BLAS-backed batched products, op by op as the CUDA executor does.
//
// "medium" keeps W in bf16 values, as the CUDA path stores it, but holds them in fp32 tensors:
// a bf16 value is exact in fp32, so an fp32 GEMM of them is the bf16 product with fp32
// accumulation, and CPUs without native bf16 GEMMs run it several times faster than ATen's bf16
// kernels. Results are rounded to bf16 where the CUDA path stores bf16 (W after a restart, Q
// before a product with W).
#include "cpu/newton_schulz_gram_cpu.h"

#include "cpu/batched_gemm.h"
#include "megatron_eopt/ns_algorithm.h"

#include "torch/aten_ops.h"

#include <array>

namespace megatron_eopt {
namespace {

bool is_x_buffer(GramBuf b) { return b == GramBuf::kX0 || b == GramBuf::kX1; }


}  // namespace

void gram_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts, const GramProgram& program) {
  const bool bf16 = opts.precision == NsPrecision::kMedium;
  const int64_t batch = w.size(0), m = w.size(1), n = w.size(2), s = program.gram_side;
  const bool transpose = opts.transpose;

  std::array<Tensor, kGramBufCount> buf;

  buf[gram_buf_index(GramBuf::kOut)] = out;
  for (GramBuf b : {GramBuf::kX0, GramBuf::kX1}) {
    if (program.uses[gram_buf_index(b)]) buf[gram_buf_index(b)] = aten::empty({batch, m, n}, kFloat, w.device());
  }
  for (GramBuf b : {GramBuf::kS0, GramBuf::kS1, GramBuf::kS2, GramBuf::kS3, GramBuf::kQx}) {
    if (program.uses[gram_buf_index(b)]) buf[gram_buf_index(b)] = aten::empty({batch, s, s}, kFloat, w.device());
  }
  const auto at_ = [&buf](GramBuf b) -> Tensor& { return buf[gram_buf_index(b)]; };
  const int64_t blocks = ns_symmetric_blocks(s, NsDevice::kCpu);
  const Tensor none;

  // W0 = x / max(||x||_F, eps) per matrix, in x's own layout (the Gram side is a choice of
  // product, not of storage).
  Tensor& x0 = at_(program.x_first);
  const Tensor norm = clamped_matrix_norms(w, opts.eps);
  aten::div_out(x0, w, norm);
  if (bf16) round_bf16_(x0);

  for (const GramOp& op : program.ops) {
    switch (op.kind) {
      case GramOpKind::kAddDiag:
        add_to_diagonal_(at_(op.d), op.alpha);
        break;
      case GramOpKind::kRound:
        aten::copy_(at_(op.d), aten::to_dtype(at_(op.a), kBFloat16));
        break;
      case GramOpKind::kGemm: {
        Tensor& d = at_(op.d);
        if (op.gemm == GramGemm::kGram) {
          const Tensor& x = at_(op.a);
          if (transpose) symmetric_gemm_out(d, aten::mT(x), x, 1.0, none, 0.0, blocks);  // X^T X
          else symmetric_gemm_out(d, x, aten::mT(x), 1.0, none, 0.0, blocks);            // X X^T
        } else if (op.gemm == GramGemm::kApply) {
          // Operands as the column-major plan orders them: (X, Q) wide, (Q, X) tall.
          const Tensor& x = transpose ? at_(op.b) : at_(op.a);
          const Tensor& q = transpose ? at_(op.a) : at_(op.b);
          if (transpose) gemm_out(d, x, q, 1.0, none, 0.0);  // X Q = (Q X^T)^T
          else gemm_out(d, q, x, 1.0, none, 0.0);            // Q X
          if (bf16 && is_x_buffer(op.d)) round_bf16_(d);
        } else {
          // s x s: every such product of the program is a polynomial in one R, so symmetric.
          symmetric_gemm_out(d, at_(op.a), at_(op.b), op.alpha, op.beta == 0.f ? none : at_(op.c), op.beta, blocks);
        }
        break;
      }
    }
  }
}

}  // namespace megatron_eopt
