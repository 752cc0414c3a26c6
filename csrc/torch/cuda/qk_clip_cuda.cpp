// CUDA glue of qk_clip_: shared checks, device guard, current stream; the kernel is in
// kernels/qk_clip.cu.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "megatron_eopt/qk_clip_cuda.h"
#include "torch/qk_clip_args.h"

namespace megatron_eopt {
namespace {

void qk_clip_cuda_op(at::TensorList weights, at::TensorList factors, at::IntArrayRef block_rows) {
  const QkClipCall call = parse_qk_clip(weights, factors, block_rows, c10::kCUDA);
  if (call.weights.empty()) return;
  const c10::cuda::OptionalCUDAGuard guard(weights[0].device());
  qk_clip_cuda(call.weights, call.type, c10::cuda::getCurrentCUDAStream());
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) { m.impl("qk_clip_", &qk_clip_cuda_op); }

}  // namespace megatron_eopt
