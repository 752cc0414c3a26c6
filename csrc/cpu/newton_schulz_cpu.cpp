// Newton–Schulz on the CPU: argument checks, the algorithm choice, and the batch loop around the
// executors (newton_schulz_standard_cpu.cpp, newton_schulz_gram_cpu.cpp).
#include "cpu/cpu_product_plan.h"
#include "cpu/newton_schulz_gram_cpu.h"
#include "ops/aten_ops.h"
#include "ops/newton_schulz_args.h"

namespace megatron_eopt {
namespace {

// Multiply-adds of one matrix's W W^T from which a batch runs one matrix at a time (every
// product of the iteration on one matrix, then the next): its W, R and Q then stay in the last-
// level cache across the products, where op-by-op over the whole batch streams the batch from
// memory for every product (faster when measured; benchmarks/RESULTS.md).
constexpr int64_t kPerMatrixMacs = int64_t{1} << 24;
constexpr int64_t kPerMatrixMacsBf16 = int64_t{1} << 27;

// Runs the iteration of x (batch, rows, cols) into out (the same shape, contiguous fp32). out may
// be x itself: both executors read x only in their first pass (the normalization, elementwise),
// before anything is written where x lies.
void run_newton_schulz_cpu(const Tensor& x, Tensor& out, NsOptions opts) {
  const int64_t side = opts.transpose ? opts.cols : opts.rows;
  const CpuIteration iteration = cpu_iteration(opts.precision, side);
  opts.precision = iteration.precision;
  // The products mode is read once per call: every matrix of a batch runs alike.
  const bool bf16_gemms = opts.precision == NsPrecision::kMedium && cpu_uses_bf16_gemms(side);
  const NsAlgorithmChoice choice = resolve_ns_algorithm(opts, NsDevice::kCpu, iteration.bf16_speedup);
  const auto run = [&](const Tensor& part, Tensor& part_out) {
    if (choice.algorithm == NsAlgorithm::kGram) gram_newton_schulz_cpu(part, part_out, opts, choice.program);
    else standard_newton_schulz_cpu(part, part_out, opts, bf16_gemms);
  };
  const int64_t per_matrix_macs = bf16_gemms ? kPerMatrixMacsBf16 : kPerMatrixMacs;
  if (opts.batch > 1 && side * side * (opts.rows * opts.cols / side) >= per_matrix_macs) {
    for (int64_t i = 0; i < opts.batch; ++i) {
      Tensor part_out = aten::narrow(out, 0, i, 1);
      run(aten::narrow(x, 0, i, 1), part_out);
    }
  } else {
    run(x, out);
  }
}

Tensor as_batch(const Tensor& x) { return x.dim() == 2 ? aten::unsqueeze(x, 0) : x; }

Tensor newton_schulz_cpu(const Tensor& x, const NsOptions& opts) {
  MEGATRON_EOPT_CHECK_VALUE(x.is_cpu(), "newton_schulz: x must be a CPU tensor here, got ", x.device());
  if (x.numel() == 0) return aten::empty_like(x);
  Tensor out = aten::empty({opts.batch, opts.rows, opts.cols}, kFloat, x.device());
  run_newton_schulz_cpu(as_batch(x), out, opts);
  return x.dim() == 2 ? aten::squeeze(out, 0) : out;
}

void newton_schulz_cpu_(const Tensor& x, const NsOptions& opts) {
  MEGATRON_EOPT_CHECK_VALUE(x.is_cpu(), "newton_schulz_: x must be a CPU tensor here, got ", x.device());
  MEGATRON_EOPT_CHECK_VALUE(x.is_contiguous(), "newton_schulz_: x must be contiguous (strides ", x.strides(), ")");
  if (x.numel() == 0) return;
  // Written through a detached alias: ATen's out= products refuse an output that requires grad
  // (x may be a non-leaf of a graph), and a refusal halfway would leave x half-written.
  Tensor batch = as_batch(aten::detach(x));
  run_newton_schulz_cpu(batch, batch, opts);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CPU, m) {
  m.impl("newton_schulz", TORCH_BOX(&newton_schulz_entry<&newton_schulz_cpu>));
  m.impl("newton_schulz_", TORCH_BOX(&newton_schulz_entry<&newton_schulz_cpu_>));
}

}  // namespace megatron_eopt
