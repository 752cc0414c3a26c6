// Batched products whose result is symmetric (W W^T, A A, and the Gram iteration's s x s products,
// all polynomials in one symmetric matrix), computed block by block: only the blocks on and above
// the diagonal are multiplied, the others are their transposes.
#pragma once

#include <ATen/core/Tensor.h>

namespace megatron_eopt {

// d = alpha * a . b + beta * c for batches of matrices, where the exact result is symmetric.
// d: contiguous (batch, s, s); a: (batch, s, k); b: (batch, k, s), any strides (transposed views
// included); c: (batch, s, s) or undefined when beta == 0. `blocks` blocks per side (1: one
// full product). d must not alias a, b or c.
void symmetric_bmm_out(at::Tensor& d, const at::Tensor& a, const at::Tensor& b, double alpha, const at::Tensor& c,
                       double beta, int64_t blocks);

}  // namespace megatron_eopt
