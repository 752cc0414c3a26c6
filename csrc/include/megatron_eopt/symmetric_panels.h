// A product whose result is symmetric (X X^T, G G, and every s x s product of the Gram iteration:
// polynomials in one R commute) computed as its lower block triangle plus a mirror, on a BLAS
// that has no symmetric product (cuBLASLt has none in bf16).
//
// The square result D (side x side, column-major, leading dimension ldc) is cut into block columns
// of `width` columns. Block column j is one GEMM, the panel D[j*width : side, j*width : (j+1)*width]
// (from its diagonal block down), reading only the rows of op(A) and the columns of op(B) it needs:
// pointer offsets on the same operands, no copy. With k blocks that multiplies (k + 1) / (2k) of
// the product (0.625 with 4, 0.5625 with 8); the upper blocks are then copied from their
// transposes (mirror_source_is_lower). The epilogue's beta C works per panel, since C is read at
// the panel's own place (C must be symmetric too, which it is in both iterations).
//
// More blocks multiply less but run thinner GEMMs and one more call each; the rule caps both.
// Torch-free (GoogleTest runs the panels through a reference GEMM).
#pragma once

#include <cstdint>
#include <vector>

#include "megatron_eopt/host_device.h"
#include "megatron_eopt/ns_gemm_plan.h"

namespace megatron_eopt {

// Panels are multiples of this many rows and columns, so every panel's operands keep the
// alignment of the full matrices (128 bytes in bf16) and whole 32 x 32 mirror tiles fall on one
// side of the block diagonal, except at the ragged edge.
constexpr int64_t kSymmetricPanelQuantum = 64;

// A rule set by the user: a side gets side / min_panel blocks, clamped to [1, max_blocks].
// max_blocks == 1 turns the panels off (one full GEMM); 0 means no rule is set (the measured
// default above applies).
struct SymmetricPanelRule {
  int64_t max_blocks;
  int64_t min_panel;
};

// Width of each block column (the last one may be narrower), a multiple of the quantum.
inline int64_t symmetric_panel_width(int64_t side, int64_t blocks) {
  if (blocks <= 1 || side <= kSymmetricPanelQuantum) return side;
  const int64_t even = (side + blocks - 1) / blocks;
  const int64_t width = (even + kSymmetricPanelQuantum - 1) / kSymmetricPanelQuantum * kSymmetricPanelQuantum;
  return width < side ? width : side;
}

// The block columns the rule gives `side`, as a panel width (side: one full product).
inline int64_t symmetric_panel_width(int64_t side, const SymmetricPanelRule& rule) {
  if (rule.max_blocks <= 1 || rule.min_panel <= 0) return side;
  int64_t blocks = side / rule.min_panel;
  if (blocks > rule.max_blocks) blocks = rule.max_blocks;
  return symmetric_panel_width(side, blocks);
}

// What the CUDA Newton–Schulz executors do when no rule is set: the configurations an H100 run
// measured faster than full products (figures in benchmarks/RESULTS.md): 4 block columns on a
// side of at least 8192, or of at least 4096 in a batch of 4 or more. Elsewhere full GEMMs: the
// narrow panels of smaller sides fill few of the GPU's SMs. TF32 and fp32 products were not
// measured: full GEMMs.
inline int64_t measured_symmetric_blocks(int64_t side, int64_t batch, bool bf16) {
  if (!bf16) return 1;
  return side >= 8192 || (side >= 4096 && batch >= 4) ? 4 : 1;
}

// D[row, col] is copied from D[col, row]: it lies above the block diagonal, in a block that no
// panel computed. Shared by the CUDA mirror kernel and the host tests.
MEGATRON_EOPT_HD bool mirror_source_is_lower(int64_t row, int64_t col, int64_t width) {
  return row / width < col / width;
}

// One panel GEMM: its shape (same leading dimensions and batch strides as the full product) and
// the element offsets of its A, B and C / D operands from the full product's.
struct GemmPanel {
  GemmShape shape;
  int64_t a_offset;
  int64_t b_offset;
  int64_t cd_offset;
};

// The panels of `full` (rows == cols) for block columns of `width`.
inline std::vector<GemmPanel> symmetric_panels(const GemmShape& full, int64_t width) {
  std::vector<GemmPanel> panels;
  const int64_t side = full.rows;
  if (width <= 0 || width >= side) {
    panels.push_back({full, 0, 0, 0});
    return panels;
  }
  for (int64_t c0 = 0; c0 < side; c0 += width) {
    const int64_t cols = c0 + width < side ? width : side - c0;
    GemmPanel p{full, 0, 0, 0};
    p.shape.rows = side - c0;  // rows c0.. of op(A): from the diagonal block down
    p.shape.cols = cols;       // columns c0..c0+cols of op(B)
    // Row r of op(A) starts at element r (A stored rows x depth) or at column r (stored depth x rows).
    p.a_offset = full.trans_a ? c0 * full.lda : c0;
    // Column c of op(B) is column c of B (stored depth x cols) or its row c (stored cols x depth).
    p.b_offset = full.trans_b ? c0 : c0 * full.ldb;
    p.cd_offset = c0 + c0 * full.ldc;
    panels.push_back(p);
  }
  return panels;
}

// Multiply-adds the panels compute, as a fraction of the full product's.
inline double symmetric_panel_fraction(int64_t side, int64_t width) {
  if (width <= 0 || width >= side) return 1.0;
  double computed = 0.0;
  for (int64_t c0 = 0; c0 < side; c0 += width) {
    const int64_t cols = c0 + width < side ? width : side - c0;
    computed += static_cast<double>(side - c0) * static_cast<double>(cols);
  }
  return computed / (static_cast<double>(side) * static_cast<double>(side));
}

}  // namespace megatron_eopt
