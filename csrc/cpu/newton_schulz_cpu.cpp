// Newton–Schulz on the CPU: ATen's BLAS-backed batched products in the compute dtype, the same
// step structure as the CUDA path (G = X X^T; B = c G G + b G; X = B X + a X).
// "high" has no TF32 on a CPU and runs in fp32, like "highest".
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <torch/library.h>

#include "torch/newton_schulz_args.h"

namespace megatron_eopt {
namespace {

at::Tensor newton_schulz_cpu(const at::Tensor& x, c10::ArrayRef<double> coefficients, int64_t steps,
                             bool repeat_last, double eps, std::optional<bool> transpose,
                             c10::string_view precision) {
  TORCH_CHECK(x.device().is_cpu(), "newton_schulz: x must be a CPU tensor here, got ", x.device());
  const NsOptions opts = parse_ns_options(x, coefficients, steps, repeat_last, eps, transpose, precision);
  if (x.numel() == 0) return at::empty_like(x, at::MemoryFormat::Contiguous);

  at::Tensor w = x.dim() == 2 ? x.unsqueeze(0) : x;
  if (opts.transpose) w = w.mT();
  const at::Tensor norm =
      at::linalg_vector_norm(w, 2, at::IntArrayRef{-2, -1}, /*keepdim=*/true).clamp_min(opts.eps);
  const auto compute = opts.precision == NsPrecision::kMedium ? at::kBFloat16 : at::kFloat;
  at::Tensor it = w.div(norm).to(compute).contiguous();
  for (const NsCoefficients& k : opts.schedule) {
    const at::Tensor gram = at::bmm(it, it.mT());
    const at::Tensor poly = at::baddbmm(gram, gram, gram, /*beta=*/k.b, /*alpha=*/k.c);
    it = at::baddbmm(it, poly, it, /*beta=*/k.a, /*alpha=*/1.0);
  }
  at::Tensor out = it.to(at::kFloat);
  if (opts.transpose) out = out.mT();
  if (x.dim() == 2) out = out.squeeze(0);
  return out.contiguous();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_eopt, CPU, m) { m.impl("newton_schulz", &newton_schulz_cpu); }

}  // namespace megatron_eopt
