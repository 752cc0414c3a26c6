// The tests' reference BLAS: column-major D = alpha op(A) op(B) + beta C over a batch, in double,
// on raw pointers (panels of a larger product are pointer offsets) with a GemmShape's layout; and
// one step of the standard Newton–Schulz iteration, written directly on row-major matrices.
#pragma once

#include <cstdint>
#include <vector>

#include "megatron_eopt/ns_gemm_plan.h"

namespace megatron_eopt::testing {

inline void reference_gemm(const GemmShape& s, int64_t batch, double alpha, const double* a, const double* b,
                           double beta, const double* c, double* d) {
  for (int64_t t = 0; t < batch; ++t) {
    for (int64_t i = 0; i < s.rows; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < s.depth; ++k) {
          const double av = s.trans_a ? a[t * s.stride_a + i * s.lda + k] : a[t * s.stride_a + k * s.lda + i];
          const double bv = s.trans_b ? b[t * s.stride_b + k * s.ldb + j] : b[t * s.stride_b + j * s.ldb + k];
          acc += av * bv;
        }
        const int64_t o = t * s.stride_c + j * s.ldc + i;
        d[o] = beta == 0.0 ? alpha * acc : alpha * acc + beta * c[o];  // as a BLAS: C unread when beta == 0
      }
    }
  }
}

// One standard Newton–Schulz step (docs/design.md §4.1) on row-major X (batch, m, n), in double:
// W = X (or X^T when `transpose`), W' = a W + (b G + c G^2) W with G = W W^T, returned as X'.
inline std::vector<double> reference_ns_step(const std::vector<double>& x, int64_t batch, int64_t m, int64_t n,
                                             bool transpose, double a, double b, double c) {
  std::vector<double> out(x.size());
  const int64_t p = transpose ? n : m, q = transpose ? m : n;
  for (int64_t t = 0; t < batch; ++t) {
    auto W = [&](int64_t i, int64_t j) {  // W is p x q
      return transpose ? x[t * m * n + j * n + i] : x[t * m * n + i * n + j];
    };
    std::vector<double> G(p * p, 0), B(p * p, 0);
    for (int64_t i = 0; i < p; ++i)
      for (int64_t j = 0; j < p; ++j)
        for (int64_t k = 0; k < q; ++k) G[i * p + j] += W(i, k) * W(j, k);
    for (int64_t i = 0; i < p; ++i)
      for (int64_t j = 0; j < p; ++j) {
        double gg = 0;
        for (int64_t k = 0; k < p; ++k) gg += G[i * p + k] * G[k * p + j];
        B[i * p + j] = c * gg + b * G[i * p + j];
      }
    for (int64_t i = 0; i < p; ++i)
      for (int64_t j = 0; j < q; ++j) {
        double acc = a * W(i, j);
        for (int64_t k = 0; k < p; ++k) acc += B[i * p + k] * W(k, j);
        (transpose ? out[t * m * n + j * n + i] : out[t * m * n + i * n + j]) = acc;
      }
  }
  return out;
}

}  // namespace megatron_eopt::testing
