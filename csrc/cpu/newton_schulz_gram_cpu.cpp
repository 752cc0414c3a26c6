// Gram Newton–Schulz on the CPU: runs a GramProgram (megatron_eopt/ns_gram_plan.h) with ATen's
// BLAS-backed batched products, op by op as the CUDA executor does.
//
// "medium" keeps W in bf16 values, as the CUDA path stores it, but holds them in fp32 tensors
// with fp32 products: the iteration needs R = W W^T with an fp32 result (a bf16-rounded R costs
// the recursion far more than the standard iteration's bf16 rounding), and ATen's CPU bf16 GEMMs
// only write bf16. A bf16 value is exact in fp32, so these are the bf16 products with fp32
// accumulation. Results are rounded to bf16 where the CUDA path stores bf16 (W after a restart, Q
// before a product with W). "auto" weighs that fp32 cost against the standard iteration's bf16
// GEMMs (ns_algorithm.h). As in the standard iteration, the program's one product with scalars,
// c R^2 + b R, is the plain GEMM R R followed by one s x s pass.
#include "cpu/newton_schulz_gram_cpu.h"

#include "cpu/batched_gemm.h"
#include "cpu/scratch_cpu.h"
#include "megatron_eopt/ns_algorithm.h"

#include "ops/aten_ops.h"

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

  CpuScratch scratch;
  buf[gram_buf_index(GramBuf::kOut)] = out;
  for (GramBuf b : {GramBuf::kX0, GramBuf::kX1}) {
    if (program.uses[gram_buf_index(b)]) buf[gram_buf_index(b)] = scratch.take({batch, m, n}, kFloat);
  }
  for (GramBuf b : {GramBuf::kS0, GramBuf::kS1, GramBuf::kS2, GramBuf::kS3, GramBuf::kQx}) {
    if (program.uses[gram_buf_index(b)]) buf[gram_buf_index(b)] = scratch.take({batch, s, s}, kFloat);
  }
  const auto at_ = [&buf](GramBuf b) -> Tensor& { return buf[gram_buf_index(b)]; };
  // Each buffer's transposed view, made on first use and kept: every view made is a dispatcher
  // call, which shows on small matrices.
  std::array<Tensor, kGramBufCount> transposed;
  const auto at_t = [&](GramBuf b) -> const Tensor& {
    Tensor& view = transposed[gram_buf_index(b)];
    if (!view.defined()) view = aten::mT(at_(b));
    return view;
  };
  const int64_t blocks = ns_symmetric_blocks(s, NsDevice::kCpu);

  // W0 = x / max(||x||_F, eps) per matrix (or the recipe's normalization), in x's own layout (the
  // Gram side is a choice of product, not of storage).
  Tensor& x0 = at_(program.x_first);
  normalize_input_out(x0, w, opts.eps, opts.recipe);
  if (bf16) round_bf16_(x0);

  for (const GramOp& op : program.ops) {
    switch (op.kind) {
      case GramOpKind::kAddDiag: add_to_diagonal_(at_(op.d), op.alpha); break;
      case GramOpKind::kRound: aten::copy_(at_(op.d), aten::to_dtype(at_(op.a), kBFloat16)); break;
      case GramOpKind::kGemm: {
        Tensor& d = at_(op.d);
        if (op.gemm == GramGemm::kGram) {
          if (transpose) gram_product_out(d, at_t(op.a), at_(op.a), blocks);  // X^T X
          else gram_product_out(d, at_(op.a), at_t(op.a), blocks);            // X X^T
        } else if (op.gemm == GramGemm::kApply) {
          // Operands as the column-major plan orders them: (X, Q) wide, (Q, X) tall.
          const Tensor& x = transpose ? at_(op.b) : at_(op.a);
          const Tensor& q = transpose ? at_(op.a) : at_(op.b);
          if (transpose) gemm_out(d, x, q);  // X Q = (Q X^T)^T
          else gemm_out(d, q, x);            // Q X
          if (bf16 && is_x_buffer(op.d)) round_bf16_(d);
        } else {
          // s x s: every such product of the program is a polynomial in one R, so symmetric.
          if (op.alpha == 1.f && op.beta == 0.f) {
            symmetric_gemm_out(d, at_(op.a), at_(op.b), blocks);
          } else {
            // The one product with scalars, c R R + b R: the plain GEMM R R, then one s x s pass.
            MEGATRON_EOPT_CHECK_VALUE(op.a == op.b && op.a == op.c,
                                      "gram program: a product with scalars must be c R R + b R");
            const Tensor& r = at_(op.a);
            if (op.alpha != 0.f) gram_product_out(d, r, at_t(op.a), blocks);  // R R = R R^T
            polynomial_out(d, op.alpha, op.alpha != 0.f ? d : r, op.beta, r, 0.f);
          }
        }
        break;
      }
    }
  }
  // Muon+: the program's last product writes the fp32 result, rescaled here in place.
  if (opts.recipe.frobenius_renorm) frobenius_renorm_out(out, out);
}

}  // namespace megatron_eopt
