#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "megatron_eopt/qk_clip.h"

using megatron_eopt::kQkClipMaxBlocksPerWeight;
using megatron_eopt::kQkClipThreads;
using megatron_eopt::kQkClipTileCols;
using megatron_eopt::plan_qk_clip;
using megatron_eopt::qk_clip_tile;
using megatron_eopt::qk_clip_tiles_per_row;
using megatron_eopt::QkClipTile;
using megatron_eopt::QkClipWeight;

namespace {

QkClipWeight weight(int64_t rows, int64_t cols, int64_t block_rows) {
  return QkClipWeight{nullptr, nullptr, rows, cols, cols, block_rows};
}

}  // namespace

TEST(QkClipTiles, TilesPerRow) {
  EXPECT_EQ(qk_clip_tiles_per_row(1, 1024), 1);
  EXPECT_EQ(qk_clip_tiles_per_row(1023, 1024), 1);
  EXPECT_EQ(qk_clip_tiles_per_row(1024, 1024), 1);
  EXPECT_EQ(qk_clip_tiles_per_row(1025, 1024), 2);
  EXPECT_EQ(qk_clip_tiles_per_row(70001, 1024), 69);
  EXPECT_EQ(qk_clip_tiles_per_row(7, 1), 7);
}

// Tiles taken in order walk the weight row by row, column by column, without gap or overlap: every
// element lies in exactly one tile, and each tile's head is its row's block.
TEST(QkClipTiles, TilesCoverEveryElementOnceInRowMajorOrder) {
  for (const int32_t tile_cols : {1, 3, 4, 32, 1024}) {
    for (const int64_t rows : {1, 2, 6, 7, 12}) {
      for (const int64_t cols : {1, 2, 5, 31, 32, 33, 64, 100, 1023, 1024, 1025, 3000}) {
        for (const int64_t block_rows : {int64_t{1}, int64_t{2}, int64_t{3}, rows}) {
          if (rows % block_rows != 0) continue;
          const int64_t per_row = qk_clip_tiles_per_row(cols, tile_cols);
          int64_t next_row = 0;
          int64_t next_col = 0;
          for (int64_t t = 0; t < rows * per_row; ++t) {
            const QkClipTile tile = qk_clip_tile(t, per_row, cols, block_rows, tile_cols);
            ASSERT_EQ(tile.row, next_row) << tile_cols << " " << rows << " " << cols << " tile " << t;
            ASSERT_EQ(tile.col, next_col) << tile_cols << " " << rows << " " << cols << " tile " << t;
            ASSERT_GE(tile.count, 1);
            ASSERT_LE(tile.count, tile_cols);
            ASSERT_LE(tile.col + tile.count, cols);
            ASSERT_EQ(tile.head, tile.row / block_rows);
            next_col = tile.col + tile.count;
            if (next_col == cols) {
              next_col = 0;
              ++next_row;
            } else {
              ASSERT_EQ(tile.count, tile_cols);  // only a row's last tile is short
            }
          }
          EXPECT_EQ(next_row, rows);
          EXPECT_EQ(next_col, 0);
        }
      }
    }
  }
}

// Past 2^31 elements and past 2^31 tiles the row, head and column stay exact (64-bit).
TEST(QkClipTiles, LargeWeightsUse64BitTiles) {
  const int64_t cols = 4097;
  const int64_t rows = 128 * 4097;  // 2^31 + 1048704 elements
  const int64_t per_row = qk_clip_tiles_per_row(cols, kQkClipTileCols);
  ASSERT_EQ(per_row, 5);
  const QkClipTile last = qk_clip_tile(rows * per_row - 1, per_row, cols, 128, kQkClipTileCols);
  EXPECT_EQ(last.row, rows - 1);
  EXPECT_EQ(last.head, 4096);
  EXPECT_EQ(last.col, 4096);
  EXPECT_EQ(last.count, 1);
  EXPECT_GT(last.row * cols + last.col, int64_t{1} << 31);
  // One column, more tiles than an int32 holds.
  const int64_t tall = (int64_t{1} << 32) + 6;
  const QkClipTile t = qk_clip_tile(tall - 1, 1, 1, 2, kQkClipTileCols);
  EXPECT_EQ(t.row, tall - 1);
  EXPECT_EQ(t.head, (tall - 1) / 2);
  EXPECT_EQ(t.col, 0);
  EXPECT_EQ(t.count, 1);
  const QkClipTile wide = qk_clip_tile(3, 2, (int64_t{1} << 33) + 5, 1, 1 << 30);
  EXPECT_EQ(wide.row, 1);
  EXPECT_EQ(wide.col, int64_t{1} << 30);
  EXPECT_EQ(wide.count, 1 << 30);
}

TEST(QkClipTiles, PlanGivesEachWeightOneWarpPerTileUpToTheCap) {
  const int warps = kQkClipThreads / 32;
  const std::vector<QkClipWeight> weights{weight(7, 1, 7), weight(4096, 4096, 128), weight(0, 5, 1),
                                          weight(3, 0, 3), weight(12, 1025, 3),     weight(9000, 5, 9)};
  const auto plan = plan_qk_clip(weights);
  const int64_t big_tiles = 4096 * 4;
  EXPECT_EQ(plan.blocks,
            (std::vector<int64_t>{1, std::min<int64_t>(big_tiles / warps, kQkClipMaxBlocksPerWeight), 0, 0, 3,
                                  std::min<int64_t>((9000 + warps - 1) / warps, kQkClipMaxBlocksPerWeight)}));
  EXPECT_EQ(plan.blocks[1], kQkClipMaxBlocksPerWeight);  // its warps take two tiles each
  ASSERT_EQ(plan.launches.size(), 1u);
  EXPECT_EQ(plan.launches[0], (std::vector<std::size_t>{0, 1, 4, 5}));
}

// The kernel's loops (csrc/cuda/kernels/qk_clip.cu) replayed on the host over the plan: blocks find their
// weight, warps stride over its tiles, lanes over a tile's columns in batches. Every element of
// every weight is visited exactly once, with its own head's factor.
TEST(QkClipTiles, KernelLoopsVisitEveryElementOnce) {
  constexpr int kWarps = kQkClipThreads / 32;
  constexpr int kBatch = 8;
  const int32_t tile_cols = 64;  // small tiles: many per row, and more tiles than warps
  const int64_t max_blocks = 3;
  std::vector<QkClipWeight> weights;
  for (int i = 0; i < 40; ++i) {
    const int64_t rows = 1 + i % 5 * 2;
    weights.push_back(weight(rows, 1 + (i * 37) % 300, i % 2 == 0 ? rows : 1));
  }
  weights.push_back(weight(60, 130, 4));
  weights.push_back(weight(1, 1, 1));
  const auto plan = plan_qk_clip(weights, tile_cols, kQkClipThreads, max_blocks);
  std::vector<std::vector<int>> hits(weights.size());
  for (std::size_t i = 0; i < weights.size(); ++i) hits[i].assign(weights[i].rows * weights[i].cols, 0);
  std::size_t launched = 0;
  for (const auto& members : plan.launches) {
    for (const std::size_t i : members) {
      const QkClipWeight& w = weights[i];
      const int64_t per_row = qk_clip_tiles_per_row(w.cols, tile_cols);
      const int64_t tiles = w.rows * per_row;
      const int64_t blocks = plan.blocks[i];
      ++launched;
      for (int64_t local = 0; local < blocks; ++local) {
        for (int warp = 0; warp < kWarps; ++warp) {
          for (int64_t t = local * kWarps + warp; t < tiles; t += blocks * kWarps) {
            const QkClipTile tile = qk_clip_tile(t, per_row, w.cols, w.block_rows, tile_cols);
            for (int lane = 0; lane < 32; ++lane) {
              for (int32_t j0 = lane; j0 < tile.count; j0 += 32 * kBatch) {
                for (int k = 0; k < kBatch; ++k) {
                  if (j0 + 32 * k >= tile.count) continue;
                  const int64_t element = tile.row * w.row_stride + tile.col + j0 + 32 * k;
                  ASSERT_EQ(tile.head, (element / w.cols) / w.block_rows);
                  ++hits[i][element];
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(launched, weights.size());   // every weight has elements
  EXPECT_EQ(plan.launches.size(), 2u);  // 42 weights: 32 + 10 descriptors
  for (std::size_t i = 0; i < weights.size(); ++i) {
    for (std::size_t e = 0; e < hits[i].size(); ++e) ASSERT_EQ(hits[i][e], 1) << "weight " << i << " element " << e;
  }
}
