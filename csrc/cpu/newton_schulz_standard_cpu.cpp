// The standard Newton–Schulz iteration (DESIGN §4.1) on the CPU: ATen's BLAS-backed products in
// the compute dtype, the same step structure as the CUDA path. X stays in its own (batch, m, n)
// layout; iterating on X^T is a choice of products (G = X^T X, X' = X B + a X with B symmetric),
// so no transpose is materialized.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linalg_vector_norm.h>

#include "cpu/batched_gemm.h"
#include "cpu/newton_schulz_gram_cpu.h"
#include "megatron_eopt/ns_algorithm.h"

namespace megatron_eopt {

void standard_newton_schulz_cpu(const at::Tensor& w, at::Tensor& out, const NsOptions& opts) {
  const at::Tensor norm =
      at::linalg_vector_norm(w, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true).clamp_min(opts.eps);
  const bool fp32 = opts.precision != NsPrecision::kMedium;
  const auto compute = fp32 ? at::kFloat : at::kBFloat16;
  at::Tensor it = w.div(norm).to(compute).contiguous();
  const bool t = opts.transpose;
  // G = W W^T and B = c G G + b G are symmetric: computed as blocks above the diagonal.
  const int64_t side = t ? it.size(2) : it.size(1);
  const int64_t blocks = ns_symmetric_blocks(side, NsDevice::kCpu);
  at::Tensor gram = at::empty({it.size(0), side, side}, it.options());
  at::Tensor poly = at::empty_like(gram);
  const at::Tensor none;
  const std::size_t steps = opts.schedule.size();
  for (std::size_t k = 0; k < steps; ++k) {
    const NsCoefficients& co = opts.schedule[k];
    if (t) symmetric_gemm_out(gram, it.mT(), it, 1.0, none, 0.0, blocks);
    else symmetric_gemm_out(gram, it, it.mT(), 1.0, none, 0.0, blocks);
    symmetric_gemm_out(poly, gram, gram, /*alpha=*/co.c, gram, /*beta=*/co.b, blocks);
    // The last fp32 step writes the output directly.
    at::Tensor next = fp32 && k + 1 == steps ? out : at::empty_like(it);
    if (t) gemm_out(next, it, poly, /*alpha=*/1.0, it, /*beta=*/co.a);  // X B + a X
    else gemm_out(next, poly, it, /*alpha=*/1.0, it, /*beta=*/co.a);    // B X + a X
    it = next;
  }
  if (!fp32) out.copy_(it);
}

}  // namespace megatron_eopt
