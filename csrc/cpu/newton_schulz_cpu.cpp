// Newton–Schulz on the CPU: ATen's BLAS-backed batched products in the compute dtype, the same
// step structure as the CUDA path (G = X X^T; B = c G G + b G; X = B X + a X), or the Gram
// iteration (newton_schulz_gram_cpu.cpp) when the algorithm argument asks or "auto" picks it.
// "high" has no TF32 on a CPU and runs in fp32, like "highest".
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <torch/library.h>

#include "cpu/newton_schulz_gram_cpu.h"
#include "cpu/symmetric_bmm.h"
#include "torch/newton_schulz_args.h"

namespace megatron_eopt {
namespace {

at::Tensor newton_schulz_cpu(const at::Tensor& x, c10::ArrayRef<double> coefficients, int64_t steps,
                             bool repeat_last, double eps, std::optional<bool> transpose,
                             c10::string_view precision, c10::string_view algorithm) {
  TORCH_CHECK(x.device().is_cpu(), "newton_schulz: x must be a CPU tensor here, got ", x.device());
  const NsOptions opts = parse_ns_options(x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm);
  if (x.numel() == 0) return at::empty_like(x, at::MemoryFormat::Contiguous);

  at::Tensor w = x.dim() == 2 ? x.unsqueeze(0) : x;
  const NsAlgorithmChoice choice = resolve_ns_algorithm(opts, NsDevice::kCpu);
  if (choice.algorithm == NsAlgorithm::kGram) {
    const at::Tensor out = gram_newton_schulz_cpu(w, opts, choice.program);
    return x.dim() == 2 ? out.squeeze(0) : out;
  }
  const at::Tensor norm =
      at::linalg_vector_norm(w, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true).clamp_min(opts.eps);
  const auto compute = opts.precision == NsPrecision::kMedium ? at::kBFloat16 : at::kFloat;
  // X stays in its own (batch, m, n) layout; iterating on X^T is a choice of products:
  // G = X^T X, X' = X B + a X (B symmetric), so no transpose is materialized.
  at::Tensor it = w.div(norm).to(compute).contiguous();
  const bool t = opts.transpose;
  // G = W W^T and B = c G G + b G are symmetric: computed as blocks above the diagonal.
  const int64_t side = t ? it.size(2) : it.size(1);
  const int64_t blocks = ns_symmetric_blocks(side, NsDevice::kCpu);
  at::Tensor gram = at::empty({it.size(0), side, side}, it.options());
  at::Tensor poly = at::empty_like(gram);
  const at::Tensor none;
  for (const NsCoefficients& k : opts.schedule) {
    if (t) symmetric_bmm_out(gram, it.mT(), it, 1.0, none, 0.0, blocks);
    else symmetric_bmm_out(gram, it, it.mT(), 1.0, none, 0.0, blocks);
    symmetric_bmm_out(poly, gram, gram, /*alpha=*/k.c, gram, /*beta=*/k.b, blocks);
    it = t ? at::baddbmm(it, it, poly, /*beta=*/k.a, /*alpha=*/1.0) : at::baddbmm(it, poly, it, /*beta=*/k.a, /*alpha=*/1.0);
  }
  at::Tensor out = it.to(at::kFloat);
  if (x.dim() == 2) out = out.squeeze(0);
  return out.contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_eopt, CPU, m) { m.impl("newton_schulz", &newton_schulz_cpu); }

}  // namespace megatron_eopt
