// The tests' reference BLAS: column-major D = alpha op(A) op(B) + beta C over a batch, in double,
// on raw pointers (panels of a larger product are pointer offsets) with a GemmShape's layout.
#pragma once

#include <cstdint>

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

}  // namespace megatron_eopt::testing
