// Batched products of the CPU Newton–Schulz paths (ATen BLAS calls).
#pragma once

#include <ATen/core/Tensor.h>

namespace megatron_eopt {

// d = alpha * a . b + beta * c over a batch: d (batch, r, q) contiguous; a (batch, r, k) and
// b (batch, k, q) with any strides (transposed views included); c like d, or undefined when
// beta == 0. Large products run one matrix at a time with all threads on each GEMM: ATen's bmm
// spreads the batch over the threads instead, which leaves a thread idle on the last matrices of
// an odd batch (3 matrices on 2 threads: 1.45x slower on the development CPU). Small ones go
// through one bmm. d must not alias a, b or c.
void gemm_out(at::Tensor& d, const at::Tensor& a, const at::Tensor& b, double alpha, const at::Tensor& c, double beta);

// The same for products whose exact result is symmetric (W W^T, A A, and the Gram iteration's
// s x s products, all polynomials in one symmetric matrix), computed block by block: only the
// `blocks` x `blocks` blocks on and above the diagonal are multiplied, the others are their
// transposes (1: one full product).
void symmetric_gemm_out(at::Tensor& d, const at::Tensor& a, const at::Tensor& b, double alpha, const at::Tensor& c,
                        double beta, int64_t blocks);

}  // namespace megatron_eopt
