// CUDA glue of the Newton–Schulz op: checks, device guard, scratch allocation from the caching
// allocator, current stream and cuBLASLt handle; the work is in kernels/newton_schulz.cu.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "megatron_eopt/newton_schulz_cuda.h"
#include "megatron_eopt/newton_schulz_gram_cuda.h"
#include "ops/aten_ops.h"
#include "cuda/cuda_context.h"
#include "ops/newton_schulz_args.h"

namespace megatron_eopt {
namespace {

// `bytes` of device memory from torch's caching allocator (a uint8 tensor on `like`'s device).
Tensor device_bytes(std::size_t bytes, const Tensor& like) {
  return aten::empty({static_cast<int64_t>(bytes)}, kByte, like.device());
}

// The BLAS workspace of one call, from the caching allocator: grown to what the largest chosen
// algorithm asks for. A replaced buffer goes back to the allocator, which reuses it only in
// stream order, after the GEMMs already enqueued on this stream.
struct TorchWorkspace {
  const Tensor& like;
  Tensor buffer;

  static void* get(void* context, std::size_t bytes) {
    auto* self = static_cast<TorchWorkspace*>(context);
    if (!self->buffer.defined() || static_cast<std::size_t>(self->buffer.numel()) < bytes) {
      self->buffer = device_bytes(bytes, self->like);
    }
    return self->buffer.data_ptr();
  }
};

LtContext blas_context(const Tensor& x, TorchWorkspace& workspace, NsProducts products) {
  LtContext ctx = cuda::blas_context(cuda::device_of(x), LtWorkspace{&workspace, &TorchWorkspace::get});
  ctx.products = products;
  return ctx;
}

// The Gram iteration (docs/design.md §4.4): one scratch allocation laid out for its program.
void run_gram(const Tensor& input, Tensor& out, const NsOptions& opts, const GramProgram& program, float* row_scales) {
  const GramScratchLayout layout = gram_scratch_layout(program, opts.batch, opts.rows, opts.cols,
                                                       ns_gram_norm_partial_slots(opts.batch, opts.rows, opts.cols));
  const Tensor buffer = device_bytes(layout.total, input);
  TorchWorkspace workspace{input, Tensor()};
  newton_schulz_gram_cuda(input.const_data_ptr<float>(), out.mutable_data_ptr<float>(), opts.batch, opts.rows,
                          opts.cols, program, opts.eps, opts.recipe, opts.precision, buffer.data_ptr(), layout,
                          row_scales, blas_context(input, workspace, opts.products));
}

// Runs the iteration of `input` (contiguous fp32) into `out` (the same shape; `input` itself where
// cuda_result_may_overwrite_input allows).
void run_newton_schulz_cuda(const Tensor& input, Tensor& out, const NsOptions& opts, const NsAlgorithmChoice& choice) {
  // MuonEq's per-row scales (batch * rows floats), from the caching allocator like the scratch.
  Tensor row_scales;
  if (opts.recipe.row_equilibration) row_scales = aten::empty({opts.batch * opts.rows}, kFloat, input.device());
  float* row_scales_ptr = row_scales.defined() ? row_scales.mutable_data_ptr<float>() : nullptr;

  if (choice.algorithm == NsAlgorithm::kGram) {
    run_gram(input, out, opts, choice.program, row_scales_ptr);
    return;
  }

  // Writing over the input, G and B may take the input's storage (ns_products_fit_in_input) where
  // it starts as aligned as a scratch allocation (a view at an offset may not).
  const bool result_over_input = out.const_data_ptr() == input.const_data_ptr() &&
                                 reinterpret_cast<std::uintptr_t>(input.const_data_ptr()) % 256 == 0;
  const NsScratchLayout layout = ns_cuda_scratch_layout(opts.batch, opts.rows, opts.cols, opts.transpose,
                                                        opts.precision, result_over_input);
  const Tensor buffer = device_bytes(layout.total, input);
  auto* base = static_cast<char*>(buffer.data_ptr());
  auto* products = layout.products_in_input ? static_cast<char*>(out.mutable_data_ptr()) : base;
  NsScratch scratch{};
  scratch.iterate[0] = layout.iterate0 == SIZE_MAX ? static_cast<void*>(out.mutable_data_ptr<float>())
                                                   : static_cast<void*>(base + layout.iterate0);
  scratch.iterate[1] = base + layout.iterate1;
  scratch.gram = products + layout.gram;
  scratch.poly = products + layout.poly;
  scratch.sum_squares = reinterpret_cast<float*>(base + layout.sum_squares);
  scratch.norm_partials = reinterpret_cast<float*>(base + layout.norm_partials);
  scratch.row_scales = row_scales_ptr;
  TorchWorkspace workspace{input, Tensor()};
  newton_schulz_cuda(input.const_data_ptr<float>(), out.mutable_data_ptr<float>(), opts.batch, opts.rows, opts.cols,
                     opts.transpose, opts.schedule, opts.eps, opts.recipe, opts.precision, scratch,
                     blas_context(input, workspace, opts.products));
}

Tensor newton_schulz_cuda_op(const Tensor& x, const NsOptions& opts) {
  MEGATRON_EOPT_CHECK_VALUE(x.is_cuda(), "newton_schulz: x must be a CUDA tensor here, got ", x.device());
  const cuda::DeviceGuard guard(cuda::device_of(x));
  const Tensor input = aten::contiguous(x);
  Tensor out = aten::empty_like(input);
  if (input.numel() == 0) return out;
  run_newton_schulz_cuda(input, out, opts, resolve_ns_algorithm(opts, NsDevice::kCuda));
  return out;
}

void newton_schulz_cuda_op_(const Tensor& x, const NsOptions& opts) {
  MEGATRON_EOPT_CHECK_VALUE(x.is_cuda(), "newton_schulz_: x must be a CUDA tensor here, got ", x.device());
  MEGATRON_EOPT_CHECK_VALUE(x.is_contiguous(), "newton_schulz_: x must be contiguous (strides ", x.strides(), ")");
  const cuda::DeviceGuard guard(cuda::device_of(x));
  if (x.numel() == 0) return;
  const NsAlgorithmChoice choice = resolve_ns_algorithm(opts, NsDevice::kCuda);
  if (cuda_result_may_overwrite_input(choice, opts.precision, opts.schedule.size())) {
    Tensor out = x;
    run_newton_schulz_cuda(x, out, opts, choice);
    return;
  }
  // The normalization would write over x while reading it: the result goes to a tensor of its own
  // and is copied back, in stream order (through a detached alias, as x may require grad).
  Tensor out = aten::empty_like(x);
  run_newton_schulz_cuda(x, out, opts, choice);
  Tensor target = aten::detach(x);
  aten::copy_(target, out);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) {
  m.impl("newton_schulz", TORCH_BOX(&newton_schulz_entry<&newton_schulz_cuda_op>));
  m.impl("newton_schulz_", TORCH_BOX(&newton_schulz_entry<&newton_schulz_cuda_op_>));
}

}  // namespace megatron_eopt
