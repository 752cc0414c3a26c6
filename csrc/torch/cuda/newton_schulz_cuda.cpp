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

// The BLAS workspace of one call, from the caching allocator: grown to what the largest chosen
// algorithm asks for. A replaced buffer goes back to the allocator, which reuses it only in
// stream order, after the GEMMs already enqueued on this stream.
struct TorchWorkspace {
  at::TensorOptions options;
  at::Tensor buffer;

  static void* get(void* context, std::size_t bytes) {
    auto* self = static_cast<TorchWorkspace*>(context);
    if (!self->buffer.defined() || static_cast<std::size_t>(self->buffer.numel()) < bytes) {
      self->buffer = at::empty({static_cast<int64_t>(bytes)}, self->options);
    }
    return self->buffer.data_ptr();
  }
};

LtContext blas_context(const at::Tensor& x, TorchWorkspace& workspace) {
  return LtContext{x.device().index(), at::cuda::getCurrentCUDABlasLtHandle(), at::cuda::getCurrentCUDABlasHandle(),
                   LtWorkspace{&workspace, &TorchWorkspace::get}, c10::cuda::getCurrentCUDAStream()};
}

// The Gram iteration (DESIGN §11): one scratch allocation laid out for its program.
void run_gram(const at::Tensor& input, at::Tensor& out, const NsOptions& opts, const GramProgram& program) {
  const GramScratchLayout layout = gram_scratch_layout(program, opts.batch, opts.rows, opts.cols,
                                                       ns_gram_norm_partial_slots(opts.batch, opts.rows, opts.cols));
  const at::Tensor buffer = at::empty({static_cast<int64_t>(layout.total)}, input.options().dtype(at::kByte));
  TorchWorkspace workspace{input.options().dtype(at::kByte), {}};
  newton_schulz_gram_cuda(input.data_ptr<float>(), out.data_ptr<float>(), opts.batch, opts.rows, opts.cols, program,
                          opts.eps, opts.precision, buffer.data_ptr(), layout, blas_context(input, workspace));
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

  const NsScratchLayout layout =
      ns_scratch_layout(opts.batch, opts.rows, opts.cols, opts.transpose, opts.precision);
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
  TorchWorkspace workspace{input.options().dtype(at::kByte), {}};
  newton_schulz_cuda(input.data_ptr<float>(), out.data_ptr<float>(), opts.batch, opts.rows, opts.cols,
                     opts.transpose, opts.schedule, opts.eps, opts.precision, scratch, blas_context(input, workspace));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) { m.impl("newton_schulz", &newton_schulz_cuda_op); }

}  // namespace megatron_eopt
