// qk_clip_ on the CPU: rows spread over the threads, each row scaled by its block's factor with
// the same per-element math as the CUDA kernel (qk_clip.h).
#include <algorithm>

#include "cpu/cpu_clones.h"
#include "megatron_eopt/qk_clip.h"
#include "ops/qk_clip_args.h"

namespace megatron_eopt {
namespace {

template <typename T>
MEGATRON_EOPT_CPU_CLONES void scale_row(T* row, int64_t cols, float factor) {
  for (int64_t c = 0; c < cols; ++c) row[c] = qk_clip_element(row[c], factor);
}

template <typename T>
void scale_weight(const QkClipWeight& w) {
  T* data = static_cast<T*>(w.data);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, w.cols));
  torch::stable::parallel_for(0, w.rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) scale_row(data + r * w.row_stride, w.cols, w.factors[r / w.block_rows]);
  });
}

void qk_clip_cpu(const TensorList& weights, const TensorList& factors, const std::vector<int64_t>& block_rows) {
  const QkClipCall call = parse_qk_clip(weights, factors, block_rows, kCPU);
  for (const QkClipWeight& w : call.weights) {
    switch (call.type) {
      case StorageType::kFloat32: scale_weight<float>(w); break;
      case StorageType::kBFloat16: scale_weight<Bf16>(w); break;
      case StorageType::kFloat16: scale_weight<Fp16>(w); break;
    }
  }
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(megatron_eopt, CPU, m) { m.impl("qk_clip_", TORCH_BOX(&qk_clip_cpu)); }

}  // namespace megatron_eopt
