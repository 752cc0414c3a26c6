// C = X X^T on the CPU computing only the blocks on and above the diagonal, in bf16 (fp32
// accumulation, the result rounded to bf16 once) or fp32: the symmetric products of the CPU
// Newton–Schulz (W W^T, W^T W and G G of the standard iteration, R = X X^T and R R of the Gram
// iteration).
//
// Why a kernel of our own: ATen's CPU GEMMs have no symmetric product, so the column panels of
// symmetric_gemm_out still multiply 2/3 of a 768-wide Gram matrix (one block of three per panel
// is wasted below the diagonal) and all of a 256-wide one. Here the upper triangle is covered by
// 8 x 32 tiles, wasting only the lower half of the 32 x 32 diagonal blocks. The tiles run at the
// CPU's peak, as oneDNN's bf16 GEMMs do (benchmarks/RESULTS.md).
//
// Method (torch-free; the glue runs the two passes with torch's thread pool):
//  1. pack: X's rows go to panels of 32 rows, each stored as [depth step][row] 32-bit words: in
//     bf16 a step is a pair of depth indices (2p in the low half, 2p + 1 in the high half), in
//     fp32 one index; zeros past the matrix. One packed copy serves both operands.
//  2. tiles: each 8 x 32 tile of C keeps 16 AVX-512 fp32 accumulators; per step it loads the 32
//     columns' words (two vectors) and broadcasts each row's word into VDPBF16PS (bf16: adds both
//     exact bf16 x bf16 products to the fp32 lane) or an FMA (fp32). bf16 results are rounded once
//     (nearest even), as oneDNN's bf16 GEMM does; only the summation order differs from ATen's.
//     A tile above the diagonal blocks also writes its transpose below them. Inside a diagonal
//     block both (i, j) and (j, i) are computed, from the same products in the same order, so they
//     are equal bit for bit and C is exactly symmetric.
#pragma once

#include <cstdint>

namespace megatron_eopt {

constexpr int64_t kSyrkPanelRows = 32;  // rows of a packed panel = columns of a C tile
constexpr int64_t kSyrkTileRows = 8;    // rows of a C tile

enum class SyrkType { kBf16, kFp32 };

// A batch of products C_b = X_b X_b^T with X_b of side x depth, X and C of one type.
struct SyrkShape {
  int64_t batch;
  int64_t side;
  int64_t depth;
  SyrkType type;

  int64_t panels() const { return (side + kSyrkPanelRows - 1) / kSyrkPanelRows; }
  // Packed words per row: depth pairs in bf16, depth indices in fp32.
  int64_t steps() const { return type == SyrkType::kBf16 ? (depth + 1) / 2 : depth; }
  int64_t packed_words_per_matrix() const { return panels() * steps() * kSyrkPanelRows; }
  int64_t packed_words() const { return batch * packed_words_per_matrix(); }
  // Depth steps per cache block of syrk_tiles: a column panel's block must stay in the L1 cache
  // while the row tiles stream past it. fp32: 128 steps, a 16 KiB block (512 steps, 64 KiB, ran
  // at 112 to 125 GFLOP/s per core against 133 to 143 on a 2.4 GHz Xeon with AVX-512, whose FMA
  // peak is 151); bf16: 512 pairs, as fast as 64 to 256 there (VDPBF16PS's rate caps it), and its
  // partial sums are needed only past 1024 deep. Figures: benchmarks/RESULTS.md.
  constexpr int64_t chunk_steps() const { return type == SyrkType::kBf16 ? 512 : 128; }
  // C tiles of one matrix: the column panel q takes the row tiles of rows [0, min(side, 32 (q + 1))).
  int64_t tiles_per_matrix() const;
  // fp32 partial sums syrk_tiles keeps where the depth spans several cache blocks (more than
  // chunk_steps()): 8 x 32 per tile of the batch, about 2 side^2 bytes per matrix; 0 otherwise.
  int64_t partial_floats() const;
};

// Whether this CPU runs the kernel for the type (x86-64 with AVX-512 F/BW/VL, and AVX512-BF16 for
// bf16); otherwise callers use ATen's GEMMs.
bool syrk_available(SyrkType type);

// Step 1 for the panels [begin, end) of the batch (batch x panels in all). Element (b, i, k) of X,
// a uint16 bf16 or a float, is x[b * batch_stride + i * row_stride + k * depth_stride].
void syrk_pack(const void* x, int64_t batch_stride, int64_t row_stride, int64_t depth_stride, const SyrkShape& shape,
               uint32_t* packed, int64_t begin, int64_t end);

// Step 2 for the tiles [begin, end) of the batch (batch x tiles_per_matrix in all): writes the
// tiles' elements of c and their mirror images, c a contiguous (batch, side, side) stack of the
// shape's type. Needs syrk_available(shape.type). `partials`: shape.partial_floats() floats of
// scratch, shared by all ranges (each tile uses its own part); null where that is 0.
void syrk_tiles(const uint32_t* packed, const SyrkShape& shape, void* c, float* partials, int64_t begin, int64_t end);

}  // namespace megatron_eopt
