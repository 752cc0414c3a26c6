// The three GEMMs of one Newton–Schulz step, laid out for a column-major BLAS.
//
// Each matrix X (m x n) is stored row-major, which a column-major BLAS sees as P = X^T (n x m,
// leading dimension n). Working on X (wide case, Gram m x m) or on X^T (tall case, Gram n x n)
// is then only a choice of transpose flags: no data is ever transposed in memory.
//
//   wide  (W = X,   p = m, q = n):  G = P^T P        B = c G G + b G    P' = P B + a P
//   tall  (W = X^T, p = n, q = m):  G = P P^T        B = c G G + b G    P' = B P + a P
//
// G and B are symmetric, so their storage order does not matter. D = alpha op(A) op(B) + beta C
// with C != D folds the b*G and a*X terms into the GEMM epilogues (no elementwise passes).
//
// The p x p matrices (G, B; the Gram iteration's R, Q, P) are scratch, so their leading dimension
// and batch stride may be padded: padded_square_ld rounds up to 8 elements (16 bytes in bf16, 32
// in fp32), which keeps every matrix of a batch on the alignment the fastest BLAS kernels need.
#pragma once

#include <cstdint>

namespace megatron_eopt {

struct GemmShape {
  int64_t rows;  // of D (and C)
  int64_t cols;  // of D (and C)
  int64_t depth; // the reduced dimension
  bool trans_a;  // A is stored (depth x rows) and used transposed
  bool trans_b;  // B is stored (cols x depth) and used transposed
  int64_t lda;
  int64_t ldb;
  int64_t ldc;   // of C and D
  int64_t stride_a;  // batch strides, in elements
  int64_t stride_b;
  int64_t stride_c;
};

// Which operand of the NS step a GEMM reads: the iterate X, the Gram G or the polynomial B.
struct NsGemmPlan {
  int64_t gram;         // side of the Gram matrix: min(m, n) unless forced otherwise
  bool work_transposed; // true when iterating on X^T
  GemmShape gram_gemm;  // G = W W^T          (A = X, B = X)
  GemmShape poly_gemm;  // B = c G G + b G    (A = G, B = G, C = G)
  GemmShape update_gemm;// X' = B W + a W     (operands ordered as (X, B) wide, (B, X) tall; C = X)
  int64_t square_ld;     // leading dimension of the p x p matrices (>= gram)
  int64_t square_stride; // their batch stride in elements: square_ld * gram
};

inline int64_t padded_square_ld(int64_t side) { return (side + 7) / 8 * 8; }

// m, n: rows and columns of each row-major matrix. `transpose`: iterate on X^T (tall inputs by
// default: m > n), so the Gram matrix is min(m, n) square. `square_ld`: leading dimension of the
// p x p matrices (0: p, unpadded).
inline NsGemmPlan make_ns_gemm_plan(int64_t m, int64_t n, bool transpose, int64_t square_ld = 0) {
  NsGemmPlan plan{};
  plan.work_transposed = transpose;
  const int64_t x_stride = m * n;
  const int64_t p = transpose ? n : m;  // Gram side
  const int64_t q = transpose ? m : n;  // reduced side
  const int64_t gld = square_ld > p ? square_ld : p;
  const int64_t g_stride = gld * p;
  plan.gram = p;
  plan.square_ld = gld;
  plan.square_stride = g_stride;
  // P is (n x m) column-major with ld n.
  if (!transpose) {
    // G (m x m) = P^T P: A = P used transposed (stored n x m), B = P (n x m), depth n.
    plan.gram_gemm = {p, p, q, true, false, n, n, gld, x_stride, x_stride, g_stride};
    // P' (n x m) = P (n x m) * B (m x m) + a P.
    plan.update_gemm = {n, m, m, false, false, n, gld, n, x_stride, g_stride, x_stride};
  } else {
    // G (n x n) = P P^T: A = P (n x m), B = P used transposed, depth m.
    plan.gram_gemm = {p, p, q, false, true, n, n, gld, x_stride, x_stride, g_stride};
    // P' (n x m) = B (n x n) * P (n x m) + a P.
    plan.update_gemm = {n, m, n, false, false, gld, n, n, g_stride, x_stride, x_stride};
  }
  plan.poly_gemm = {p, p, p, false, false, gld, gld, gld, g_stride, g_stride, g_stride};
  return plan;
}

}  // namespace megatron_eopt
