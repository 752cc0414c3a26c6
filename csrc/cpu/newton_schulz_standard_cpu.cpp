// The standard Newton–Schulz iteration (DESIGN §4.1) on the CPU: ATen's BLAS-backed fp32 products,
// the same step structure as the CUDA path; "medium" rounds X, G and B to bf16 values where the
// CUDA path stores them in bf16 (held in fp32 tensors, see round_bf16_). X stays in its own (batch, m, n)
// layout; iterating on X^T is a choice of products (G = X^T X, X' = X B + a X with B symmetric),
// so no transpose is materialized.
#include "cpu/batched_gemm.h"
#include "cpu/newton_schulz_gram_cpu.h"
#include "megatron_eopt/ns_algorithm.h"
#include "torch/aten_ops.h"

namespace megatron_eopt {

void standard_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts) {
  const Tensor norm = clamped_matrix_norms(w, opts.eps);
  const bool bf16 = opts.precision == NsPrecision::kMedium;
  Tensor it = aten::contiguous(aten::div(w, norm));
  if (bf16) round_bf16_(it);
  const bool t = opts.transpose;
  // G = W W^T and B = c G G + b G are symmetric: computed as blocks above the diagonal.
  const int64_t side = t ? it.size(2) : it.size(1);
  const int64_t blocks = ns_symmetric_blocks(side, NsDevice::kCpu);
  Tensor gram = aten::empty({it.size(0), side, side}, it.scalar_type(), it.device());
  Tensor poly = aten::empty_like(gram);
  const Tensor none;
  const std::size_t steps = opts.schedule.size();
  for (std::size_t k = 0; k < steps; ++k) {
    const NsCoefficients& co = opts.schedule[k];
    if (t) symmetric_gemm_out(gram, aten::mT(it), it, 1.0, none, 0.0, blocks);
    else symmetric_gemm_out(gram, it, aten::mT(it), 1.0, none, 0.0, blocks);
    if (bf16) round_bf16_(gram);
    symmetric_gemm_out(poly, gram, gram, /*alpha=*/co.c, gram, /*beta=*/co.b, blocks);
    if (bf16) round_bf16_(poly);
    // The last step writes the output directly.
    Tensor next = k + 1 == steps ? out : aten::empty_like(it);
    if (t) gemm_out(next, it, poly, /*alpha=*/1.0, it, /*beta=*/co.a);  // X B + a X
    else gemm_out(next, poly, it, /*alpha=*/1.0, it, /*beta=*/co.a);    // B X + a X
    if (bf16) round_bf16_(next);
    it = next;
  }
}

}  // namespace megatron_eopt
