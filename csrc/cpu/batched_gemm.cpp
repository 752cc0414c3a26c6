#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "cpu/batched_gemm.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

namespace megatron_eopt {
namespace {

// Multiply-adds per matrix from which one GEMM per matrix beats one bmm (about 128^3: below it
// the per-call overhead of a loop shows, above it every GEMM keeps both threads busy).
constexpr int64_t kPerMatrixLoopMacs = int64_t{1} << 21;

}  // namespace

void gemm_out(at::Tensor& d, const at::Tensor& a, const at::Tensor& b, double alpha, const at::Tensor& c, double beta) {
  const bool add_c = beta != 0.0;
  const int64_t batch = d.size(0);
  if (batch > 1 && a.size(1) * a.size(2) * b.size(2) >= kPerMatrixLoopMacs) {
    for (int64_t i = 0; i < batch; ++i) {
      at::Tensor di = d.select(0, i);
      if (add_c) {
        at::addmm_out(di, c.select(0, i), a.select(0, i), b.select(0, i), beta, alpha);
      } else {
        at::mm_out(di, a.select(0, i), b.select(0, i));
        if (alpha != 1.0) di.mul_(alpha);
      }
    }
    return;
  }
  if (add_c) {
    at::baddbmm_out(d, c, a, b, beta, alpha);
  } else {
    at::bmm_out(d, a, b);
    if (alpha != 1.0) d.mul_(alpha);
  }
}

void symmetric_gemm_out(at::Tensor& d, const at::Tensor& a, const at::Tensor& b, double alpha, const at::Tensor& c,
                        double beta, int64_t blocks) {
  if (blocks <= 1) {
    gemm_out(d, a, b, alpha, c, beta);
    return;
  }
  const int64_t s = d.size(-1);
  const bool add_c = beta != 0.0;
  const auto edge = [s, blocks](int64_t i) { return s * i / blocks; };
  // Blocks are large (ns_symmetric_blocks: at least 256 rows), so one matrix at a time, each block
  // written in place: a block of a row-major matrix is a strided matrix BLAS writes directly.
  for (int64_t t = 0; t < d.size(0); ++t) {
    at::Tensor dt = d.select(0, t);
    const at::Tensor at_ = a.select(0, t), bt = b.select(0, t);
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t r0 = edge(i), rows = edge(i + 1) - r0;
      const at::Tensor a_rows = at_.narrow(0, r0, rows);
      for (int64_t j = i; j < blocks; ++j) {
        const int64_t c0 = edge(j), cols = edge(j + 1) - c0;
        at::Tensor block = dt.narrow(0, r0, rows).narrow(1, c0, cols);
        if (add_c) {
          at::addmm_out(block, c.select(0, t).narrow(0, r0, rows).narrow(1, c0, cols), a_rows, bt.narrow(1, c0, cols),
                        beta, alpha);
        } else {
          at::mm_out(block, a_rows, bt.narrow(1, c0, cols));
          if (alpha != 1.0) block.mul_(alpha);
        }
      }
    }
    // The blocks below the diagonal: transposes of those above.
    for (int64_t i = 0; i < blocks; ++i) {
      for (int64_t j = i + 1; j < blocks; ++j) {
        const int64_t r0 = edge(i), rows = edge(i + 1) - r0, c0 = edge(j), cols = edge(j + 1) - c0;
        dt.narrow(0, c0, cols).narrow(1, r0, rows).copy_(dt.narrow(0, r0, rows).narrow(1, c0, cols).t());
      }
    }
  }
}

}  // namespace megatron_eopt
