#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "cpu/symmetric_bmm.h"

#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>

namespace megatron_eopt {

void symmetric_bmm_out(at::Tensor& d, const at::Tensor& a, const at::Tensor& b, double alpha, const at::Tensor& c,
                       double beta, int64_t blocks) {
  const int64_t s = d.size(-1);
  const bool add_c = beta != 0.0;
  if (blocks <= 1) {
    if (add_c) {
      at::baddbmm_out(d, c, a, b, beta, alpha);
    } else {
      at::bmm_out(d, a, b);
      if (alpha != 1.0) d.mul_(alpha);
    }
    return;
  }
  const auto edge = [s, blocks](int64_t i) { return s * i / blocks; };
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t r0 = edge(i), rows = edge(i + 1) - r0;
    const at::Tensor a_rows = a.narrow(1, r0, rows);
    for (int64_t j = i; j < blocks; ++j) {
      const int64_t c0 = edge(j), cols = edge(j + 1) - c0;
      const at::Tensor b_cols = b.narrow(2, c0, cols);
      at::Tensor block;
      if (add_c) {
        block = at::baddbmm(c.narrow(1, r0, rows).narrow(2, c0, cols), a_rows, b_cols, beta, alpha);
      } else {
        block = at::bmm(a_rows, b_cols);
        if (alpha != 1.0) block.mul_(alpha);
      }
      d.narrow(1, r0, rows).narrow(2, c0, cols).copy_(block);
      if (j != i) d.narrow(1, c0, cols).narrow(2, r0, rows).copy_(block.mT());
    }
  }
}

}  // namespace megatron_eopt
