// QK-clip row scaling on CUDA: each block of a launch serves one weight (tensor_list_plan.h); its
// warps walk the weight's tiles (qk_clip.h: up to kQkClipTileCols columns of one row), each tile
// scaled by one warp with its row's factor loaded once. Torch-free.
#include <cuda_runtime.h>

#include "megatron_eopt/qk_clip_cuda.h"
#include "megatron_eopt/tensor_list_plan.h"
#include "tensor_list_kernel.cuh"

namespace megatron_eopt {
namespace {

constexpr int kWarps = kQkClipThreads / 32;
constexpr int kBatch = 8;  // elements per lane loaded before any is stored (loads in flight)
static_assert(kQkClipThreads % 32 == 0, "whole warps");

struct QkClipTiles {
  QkClipWeight w;
  int64_t tiles_per_row;
  int64_t tiles;  // rows * tiles_per_row
};

template <typename T>
__global__ void __launch_bounds__(kQkClipThreads)
    qk_clip_kernel(const __grid_constant__ TensorListArgs<QkClipTiles> args) {
  const BlockSlot slot = block_slot(args);
  const QkClipTiles d = args.tensors[slot.tensor];
  const int lane = static_cast<int>(threadIdx.x % 32);
  // Warp-uniform loop: every lane of a warp works on the same tile.
  for (int64_t t = slot.local * kWarps + threadIdx.x / 32; t < d.tiles; t += slot.blocks * kWarps) {
    const QkClipTile tile = qk_clip_tile(t, d.tiles_per_row, d.w.cols, d.w.block_rows, kQkClipTileCols);
    const float factor = d.w.factors[tile.head];
    T* row = static_cast<T*>(d.w.data) + tile.row * d.w.row_stride + tile.col;  // 64-bit address
    // Lane l scales columns l, l + 32, l + 64, ... of the tile (coalesced across the warp), in
    // batches of kBatch: every batch's loads are issued before its stores.
    for (int32_t j0 = lane; j0 < tile.count; j0 += 32 * kBatch) {
      T v[kBatch];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (j0 + 32 * k < tile.count) v[k] = row[j0 + 32 * k];
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        if (j0 + 32 * k < tile.count) row[j0 + 32 * k] = qk_clip_element(v[k], factor);
      }
    }
  }
}

template <typename T>
void launch(const std::vector<QkClipWeight>& weights, cudaStream_t stream) {
  const TensorListPlan plan = plan_qk_clip(weights);
  launch_tensor_list<QkClipTiles>(plan, kQkClipThreads, stream, qk_clip_kernel<T>, [&](std::size_t i) {
    const QkClipWeight& w = weights[i];
    const int64_t per_row = qk_clip_tiles_per_row(w.cols, kQkClipTileCols);
    return QkClipTiles{w, per_row, w.rows * per_row};
  });
}

}  // namespace

void qk_clip_cuda(const std::vector<QkClipWeight>& weights, StorageType type, cudaStream_t stream) {
  switch (type) {
    case StorageType::kFloat32: launch<float>(weights, stream); break;
    case StorageType::kBFloat16: launch<Bf16>(weights, stream); break;
    case StorageType::kFloat16: launch<Fp16>(weights, stream); break;
  }
}

}  // namespace megatron_eopt
