// Batched products of the CPU Newton–Schulz paths (ATen BLAS calls through the dispatcher) and
// their small element steps.
#pragma once

#include "torch/stable.h"

namespace megatron_eopt {

// d = alpha * a . b + beta * c over a batch: d (batch, r, q) contiguous; a (batch, r, k) and
// b (batch, k, q) with any strides (transposed views included); c like d, or undefined when
// beta == 0. Large products run one matrix at a time with all threads on each GEMM: ATen's bmm
// spreads the batch over the threads instead, which leaves a thread idle on the last matrices of
// an odd batch (3 matrices on 2 threads: 1.45x slower on the development CPU). Small ones go
// through one bmm. d must not alias a, b or c.
void gemm_out(Tensor& d, const Tensor& a, const Tensor& b, double alpha, const Tensor& c, double beta);

// The same for products whose exact result is symmetric (W W^T, A A, and the Gram iteration's
// s x s products, all polynomials in one symmetric matrix), computed block by block: only the
// `blocks` x `blocks` blocks on and above the diagonal are multiplied, the others are their
// transposes (1: one full product).
void symmetric_gemm_out(Tensor& d, const Tensor& a, const Tensor& b, double alpha, const Tensor& c,
                        double beta, int64_t blocks);

// max(||w_i||_F, eps) of each matrix of a (batch, m, n) fp32 stack, as a (batch, 1, 1) tensor
// (NaN stays NaN, as in torch.clamp_min).
Tensor clamped_matrix_norms(const Tensor& w, float eps);

// Rounds a contiguous fp32 tensor's values to bf16 in place (they stay fp32 tensors: a bf16 value is exact
// in fp32, so fp32 products of such values are bf16 products with fp32 accumulation, which CPUs
// without native bf16 GEMMs run several times faster than ATen's bf16 kernels).
void round_bf16_(Tensor& t);

// d[i, k, k] += alpha for a contiguous fp32 (batch, s, s) stack.
void add_to_diagonal_(Tensor& d, float alpha);

}  // namespace megatron_eopt
