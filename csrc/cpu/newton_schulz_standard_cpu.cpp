// The standard Newton–Schulz iteration (DESIGN §4.1) on the CPU with ATen's BLAS-backed products:
// for "medium" the two products with the long side (W W^T, B W) are ATen's bf16 GEMMs (fp32
// accumulation, as the CUDA path and the peers) and the s x s one is fp32 (see below); otherwise
// everything is fp32 ("high" has no TF32 on a CPU).
//
// Each product is one plain GEMM (DESIGN §12): with G = W W^T, a step's
//   B = b G + c G^2 = G (c G + b I)   and   W' = a W + B W = (B + a I) W,
// so the scalars land in s x s operands (c G + b I is one s^2 pass, + a I touches s elements)
// instead of a full-size pass over W after the product. With c = 0 the G G product is skipped.
// Iterating on W^T (tall inputs) is a choice of products (G = W^T W, W' = W (B + a I), B
// symmetric), so no transpose is materialized.
#include "cpu/batched_gemm.h"
#include "cpu/newton_schulz_gram_cpu.h"
#include "megatron_eopt/ns_algorithm.h"
#include "torch/aten_ops.h"

namespace megatron_eopt {

void standard_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts) {
  const bool bf16 = opts.precision == NsPrecision::kMedium;
  const ScalarType type = bf16 ? kBFloat16 : kFloat;
  const bool t = opts.transpose;
  const int64_t batch = w.size(0), m = w.size(1), n = w.size(2), side = t ? n : m;
  const std::size_t steps = opts.schedule.size();

  // In fp32 the last step writes the output directly; in bf16 its result is widened at the end.
  Tensor it = aten::empty({batch, m, n}, type, w.device());
  normalize_out(it, w, clamped_matrix_norms(w, opts.eps));
  Tensor spare = !bf16 && steps == 1 ? Tensor() : aten::empty_like(it);
  // G = W W^T in the compute type (one rounding, as the peers' bf16 product); then, in fp32, its
  // factor c G + b I and B = G (c G + b I); and B + a I in the compute type, rounded once. In bf16,
  // rounding B before adding a I would cost B's large diagonal (about -a) a rounding that the
  // small sum a + B_kk then carries at several times its own unit roundoff (polar_express on
  // 97 x 37: 3.6% from float64 against the peers' 1.3%), and so would a bf16 factor; the s x s
  // product in fp32 keeps the bf16 result as close to float64 as the peers' fused bf16 recipe.
  // All these are symmetric, so computed as blocks above the diagonal.
  const int64_t blocks = ns_symmetric_blocks(side, NsDevice::kCpu);
  Tensor gram = aten::empty({batch, side, side}, type, w.device());
  Tensor gram_fp32 = bf16 ? aten::empty({batch, side, side}, kFloat, w.device()) : gram;
  Tensor factor = aten::empty({batch, side, side}, kFloat, w.device());
  Tensor poly_fp32 = aten::empty_like(factor);
  Tensor poly = bf16 ? aten::empty_like(gram) : poly_fp32;
  for (std::size_t k = 0; k < steps; ++k) {
    const NsCoefficients& co = opts.schedule[k];
    if (t) symmetric_gemm_out(gram, aten::mT(it), it, blocks);
    else symmetric_gemm_out(gram, it, aten::mT(it), blocks);
    if (co.c != 0.0f) {
      if (bf16) scaled_plus_identity_out(gram_fp32, gram, 1.0f, 0.0f);
      scaled_plus_identity_out(factor, gram_fp32, co.c, co.b);
      symmetric_gemm_out(poly_fp32, gram_fp32, factor, blocks);
      if (bf16) scaled_plus_identity_out(poly, poly_fp32, 1.0f, co.a);
      else add_to_diagonal_(poly, co.a);
    } else {
      scaled_plus_identity_out(poly, gram, co.b, co.a);
    }
    Tensor next = !bf16 && k + 1 == steps ? out : spare;
    if (t) gemm_out(next, it, poly);  // W (B + a I)
    else gemm_out(next, poly, it);    // (B + a I) W
    spare = it;
    it = next;
  }
  if (bf16) aten::copy_(out, it);
}

}  // namespace megatron_eopt
