// CUDA glue of qk_clip_: shared checks, device guard, current stream; the kernel is in
// kernels/qk_clip.cu.
#include "megatron_eopt/qk_clip_cuda.h"
#include "cuda/cuda_context.h"
#include "ops/qk_clip_args.h"

namespace megatron_eopt {
namespace {

void qk_clip_cuda_op(const TensorList& weights, const TensorList& factors, const std::vector<int64_t>& block_rows) {
  const QkClipCall call = parse_qk_clip(weights, factors, block_rows, kCUDA);
  if (call.weights.empty()) return;
  const cuda::OpDevice device(weights[0]);
  qk_clip_cuda(call.weights, call.type, device.stream);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CUDA, m) { m.impl("qk_clip_", TORCH_BOX(&qk_clip_cuda_op)); }

}  // namespace megatron_eopt
