// C = X X^T for bf16 X with an fp32 accumulation, computing only the blocks on and above the
// diagonal: the symmetric products of the CPU Newton–Schulz at "medium" (W W^T, W^T W, G G).
//
// Why a kernel of our own: ATen's CPU bf16 GEMMs (oneDNN) already run at the AVX512-BF16 peak,
// but have no symmetric product, so the row panels of symmetric_gemm_out still multiply 2/3 of
// a 768-wide Gram matrix (1 block of 3 per row panel is wasted below the diagonal) and all of a
// 256-wide one. Here the upper triangle is covered by 8 x 32 tiles, wasting only the lower half
// of the 32 x 32 diagonal blocks.
//
// Method (torch-free; the glue runs the two passes below with torch's thread pool):
//  1. pack: X's rows go to panels of 32 rows, each stored as [pair of depth indices][row] of
//     32-bit words holding two bf16 (depth 2p in the low half, 2p + 1 in the high half; zeros past
//     the matrix). One packed copy serves both operands.
//  2. tiles: each 8 x 32 tile of C keeps 16 AVX-512 fp32 accumulators; per depth pair it loads
//     the 32 columns' words (two vectors) and broadcasts each row's word into VDPBF16PS, which
//     adds both exact bf16 x bf16 products to the fp32 lane. The result is rounded to bf16 once
//     (nearest even), as oneDNN's bf16 GEMM does; only the summation order differs from it.
//     A tile above the diagonal blocks also writes its transpose below them. Inside a diagonal
//     block both (i, j) and (j, i) are computed, from the same products in the same order, so they
//     are equal bit for bit and C is exactly symmetric.
#pragma once

#include <cstdint>

#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

constexpr int64_t kSyrkPanelRows = 32;  // rows of a packed panel = columns of a C tile
constexpr int64_t kSyrkTileRows = 8;    // rows of a C tile

// A batch of products C_b = X_b X_b^T with X_b of side x depth.
struct SyrkBf16Shape {
  int64_t batch;
  int64_t side;
  int64_t depth;

  int64_t panels() const { return (side + kSyrkPanelRows - 1) / kSyrkPanelRows; }
  int64_t pairs() const { return (depth + 1) / 2; }
  // 32-bit words of the packed copy of one matrix, and of the batch.
  int64_t packed_words_per_matrix() const { return panels() * pairs() * kSyrkPanelRows; }
  int64_t packed_words() const { return batch * packed_words_per_matrix(); }
  // C tiles of one matrix: the column panel q takes the row tiles of rows [0, min(side, 32 (q + 1))).
  int64_t tiles_per_matrix() const;
};

// Whether this CPU runs the kernel (x86-64 with AVX512-BF16); otherwise callers use ATen's GEMMs.
bool syrk_bf16_available();

// Step 1 for the panels [begin, end) of the batch (batch x panels in all). Element (b, i, k) of X
// is x[b * batch_stride + i * row_stride + k * depth_stride].
void syrk_bf16_pack(const Bf16* x, int64_t batch_stride, int64_t row_stride, int64_t depth_stride,
                    const SyrkBf16Shape& shape, uint32_t* packed, int64_t begin, int64_t end);

// Step 2 for the tiles [begin, end) of the batch (batch x tiles_per_matrix in all): writes the
// tiles' elements of c and their mirror images, a contiguous (batch, side, side) bf16 stack. Needs syrk_bf16_available().
void syrk_bf16_tiles(const uint32_t* packed, const SyrkBf16Shape& shape, Bf16* c, int64_t begin, int64_t end);

}  // namespace megatron_eopt
