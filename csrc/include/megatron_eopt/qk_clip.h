// QK-clip (MuonClip): rows of attention weights scaled per head, in place. A weight (rows x cols)
// is cut into blocks of `block_rows` consecutive rows (one attention head of a q, k or fused QKV
// projection); block b is multiplied by factors[b]. The factors (sqrt(tau / logit) and the like)
// are computed by the caller; the op does the memory-bound part for every weight of every layer
// in one pass. Torch-free: the descriptor the CPU loop and the CUDA kernel share, and the CUDA
// kernel's tiling and launch plan (host functions, unit-tested without a GPU).
#pragma once

#include <cstdint>
#include <vector>

#include "megatron_eopt/host_device.h"
#include "megatron_eopt/storage_types.h"
#include "megatron_eopt/tensor_list_plan.h"

namespace megatron_eopt {

struct QkClipWeight {
  void* data;            // rows x cols, row stride `row_stride` elements, columns contiguous
  const float* factors;  // rows / block_rows values
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t block_rows;
};

// One element: the product in fp32, rounded once to the weight's dtype.
template <typename T>
MEGATRON_EOPT_HD T qk_clip_element(T w, float factor) {
  return from_float<T>(to_float(w) * factor);
}

// ---- CUDA tiling (kernels/qk_clip.cu)
// A weight of rows x cols is cut into tiles of at most `tile_cols` consecutive columns of one row,
// numbered row by row: rows * ceil(cols / tile_cols) tiles, tile t in row t / tiles_per_row. A
// warp scales a whole tile with its row's factor loaded once, so the row and head of a tile cost
// two 64-bit divisions per tile, none per element; the lanes index the tile's columns with 32-bit
// offsets (< tile_cols), the row's address stays 64-bit (weights may exceed 2^31 elements).
constexpr int32_t kQkClipTileCols = 1024;            // 32 elements per lane of a warp
constexpr int kQkClipThreads = 256;                  // per block: 8 warps, 8 tiles at a time
constexpr int64_t kQkClipMaxBlocksPerWeight = 1024;  // a weight's warps then loop over its tiles

struct QkClipTile {
  int64_t row;    // the tile's row
  int64_t head;   // row / block_rows: the index of its factor
  int64_t col;    // its first column
  int32_t count;  // its columns: min(tile_cols, cols - col), at least 1
};

MEGATRON_EOPT_HD int64_t qk_clip_tiles_per_row(int64_t cols, int32_t tile_cols) {
  return cols / tile_cols + (cols % tile_cols != 0 ? 1 : 0);
}

// Tile `tile` (0 <= tile < rows * tiles_per_row) of a weight with `cols` >= 1 columns.
MEGATRON_EOPT_HD QkClipTile qk_clip_tile(int64_t tile, int64_t tiles_per_row, int64_t cols, int64_t block_rows,
                                         int32_t tile_cols) {
  const int64_t row = tile / tiles_per_row;
  const int64_t col = (tile - row * tiles_per_row) * tile_cols;
  const int64_t left = cols - col;
  return {row, row / block_rows, col, static_cast<int32_t>(left < tile_cols ? left : tile_cols)};
}

// Blocks per weight and launches: a block's warps take one tile each per pass (weights without
// elements get no block).
inline TensorListPlan plan_qk_clip(const std::vector<QkClipWeight>& weights, int32_t tile_cols = kQkClipTileCols,
                                   int threads = kQkClipThreads,
                                   int64_t max_blocks_per_weight = kQkClipMaxBlocksPerWeight) {
  std::vector<int64_t> tiles;
  tiles.reserve(weights.size());
  for (const QkClipWeight& w : weights) {
    tiles.push_back(w.rows > 0 && w.cols > 0 ? w.rows * qk_clip_tiles_per_row(w.cols, tile_cols) : 0);
  }
  return plan_tensor_list(tiles, threads / 32, max_blocks_per_weight);
}

}  // namespace megatron_eopt
