// CUDA glue of the Newton–Schulz op: checks, device guard, scratch allocation from the caching
// allocator, current stream and cuBLASLt handle; the work is in kernels/newton_schulz.cu.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "megatron_eopt/newton_schulz_cuda.h"
#include "megatron_eopt/newton_schulz_gram_cuda.h"
#include "torch/newton_schulz_args.h"

namespace megatron_eopt {
namespace {

// cuBLASLt workspace per call; Hopper's fastest kernels ask for up to 32 MiB.
constexpr std::size_t kBlasWorkspaceBytes = 32u << 20;

// The Gram iteration (DESIGN §11): one scratch allocation laid out for its program.
void run_gram(const at::Tensor& input, at::Tensor& out, const NsOptions& opts, const GramProgram& program) {
  const GramScratchLayout layout =
      gram_scratch_layout(program, opts.batch, opts.rows, opts.cols,
                          ns_gram_norm_partial_slots(opts.batch, opts.rows, opts.cols), kBlasWorkspaceBytes);
  const at::Tensor buffer = at::empty({static_cast<int64_t>(layout.total)}, input.options().dtype(at::kByte));
  newton_schulz_gram_cuda(input.data_ptr<float>(), out.data_ptr<float>(), opts.batch, opts.rows, opts.cols, program,
                          opts.eps, opts.precision, buffer.data_ptr(), layout, input.device().index(),
                          at::cuda::getCurrentCUDABlasLtHandle(), c10::cuda::getCurrentCUDAStream());
}

at::Tensor newton_schulz_cuda_op(const at::Tensor& x, c10::ArrayRef<double> coefficients, int64_t steps,
                                 bool repeat_last, double eps, std::optional<bool> transpose,
                                 c10::string_view precision, c10::string_view algorithm) {
  TORCH_CHECK(x.is_cuda(), "newton_schulz: x must be a CUDA tensor here, got ", x.device());
  const NsOptions opts = parse_ns_options(x, coefficients, steps, repeat_last, eps, transpose, precision, algorithm);
  const c10::cuda::OptionalCUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  at::Tensor out = at::empty_like(input, at::MemoryFormat::Contiguous);
  if (input.numel() == 0) return out;

  const NsAlgorithmChoice choice = resolve_ns_algorithm(opts, NsDevice::kCuda);
  if (choice.algorithm == NsAlgorithm::kGram) {
    run_gram(input, out, opts, choice.program);
    return out;
  }

  const NsScratchLayout layout = ns_scratch_layout(opts.batch, opts.rows, opts.cols, opts.transpose,
                                                   opts.precision, kBlasWorkspaceBytes);
  const at::Tensor buffer = at::empty({static_cast<int64_t>(layout.total)}, input.options().dtype(at::kByte));
  auto* base = static_cast<char*>(buffer.data_ptr());
  NsScratch scratch{};
  scratch.iterate[0] = layout.iterate0 == SIZE_MAX ? static_cast<void*>(out.data_ptr<float>())
                                                   : static_cast<void*>(base + layout.iterate0);
  scratch.iterate[1] = base + layout.iterate1;
  scratch.gram = base + layout.gram;
  scratch.poly = base + layout.poly;
  scratch.sum_squares = reinterpret_cast<float*>(base + layout.sum_squares);
  scratch.norm_partials = reinterpret_cast<float*>(base + layout.norm_partials);
  scratch.blas_workspace = base + layout.blas_workspace;
  scratch.blas_workspace_bytes = kBlasWorkspaceBytes;

  newton_schulz_cuda(input.data_ptr<float>(), out.data_ptr<float>(), opts.batch, opts.rows, opts.cols,
                     opts.transpose, opts.schedule, opts.eps, opts.precision, scratch, input.device().index(),
                     at::cuda::getCurrentCUDABlasLtHandle(), c10::cuda::getCurrentCUDAStream());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) { m.impl("newton_schulz", &newton_schulz_cuda_op); }

}  // namespace megatron_eopt
