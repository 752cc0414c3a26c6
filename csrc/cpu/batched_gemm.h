// Batched products of the CPU Newton–Schulz paths (ATen BLAS calls through the dispatcher) and
// the small element steps that fold the iteration's scalars into operands, so that every product
// is one plain GEMM (the stable dispatcher carries no Scalar, so addmm / baddbmm's alpha and beta
// are out of reach, and a separate full-size pass after each product would cost a memory sweep).
#pragma once

#include "megatron_eopt/ns_recipe.h"
#include "ops/stable.h"

namespace megatron_eopt {

// d = a . b over a batch: d (batch, r, q) contiguous; a (batch, r, k) and b (batch, k, q) with any
// strides (transposed views included); all fp32, or all bf16 (ATen's bf16 GEMM: fp32
// accumulation, the result rounded to bf16 once). Whether the batch runs as one bmm or one GEMM
// per matrix is gemm_loops_per_matrix's choice. d must not alias a or b.
void gemm_out(Tensor& d, const Tensor& a, const Tensor& b);

// The same for products whose exact result is symmetric (W W^T, and the polynomials in one
// symmetric matrix of both iterations), computed in `blocks` column panels: only the blocks on
// and below the diagonal are multiplied (one GEMM per column panel), the others are their transposes
// (1: one full product).
void symmetric_gemm_out(Tensor& d, const Tensor& a, const Tensor& b, int64_t blocks);

// d = x . x^T on the symmetric kernel (needs syrk_available for d's type): only the upper
// triangle's 8 x 32 tiles are multiplied; a packed copy of x is the scratch.
void symmetric_kernel_out(Tensor& d, const Tensor& x);

// One GEMM per matrix (all threads on each) rather than one bmm over the batch, for `batch`
// matrices of `macs` multiply-adds each in the given element size (2: bf16, 4: fp32).
bool gemm_loops_per_matrix(int64_t batch, int64_t macs, int64_t element_bytes);

// d = c * h + b * g + a * I for contiguous (batch, s, s) stacks, each fp32 or bf16 (they may
// differ), computed in fp32 and rounded once: a Newton–Schulz step's B + a I = c G^2 + b G + a I
// from G and G^2, and the Gram iteration's c R^2 + b R. d may be h or g. Rows run in parallel.
void polynomial_out(Tensor& d, float c, const Tensor& h, float b, const Tensor& g, float a);

// d[i, k, k] += alpha for a contiguous (batch, s, s) stack, fp32 or bf16 (computed in fp32,
// rounded once).
void add_to_diagonal_(Tensor& d, float alpha);

// max(||w_i||_F, eps) of each matrix of a (batch, m, n) fp32 stack, as a (batch, 1, 1) tensor
// (NaN stays NaN, as in torch.clamp_min).
Tensor clamped_matrix_norms(const Tensor& w, float eps);

// out = w / norms per matrix, written in out's dtype (fp32, or bf16 rounded to nearest even) in one
// parallel pass; w (batch, m, n) fp32 with any strides, out contiguous, norms from
// clamped_matrix_norms.
void normalize_out(Tensor& out, const Tensor& w, const Tensor& norms);

// The iteration's input pass with the recipe folded in (ns_recipe.h): out = w / max(||w||_F, eps)
// per matrix with the default recipe (normalize_out, unchanged); another convention or divisor
// changes only the per-matrix denominator; with MuonEq the row norms come from one read of w
// (double accumulation, ||w||_F their sum) and one pass writes w[i, :] * row_scale_i.
void normalize_input_out(Tensor& out, const Tensor& w, float eps, const NsRecipe& recipe);

// Muon+ (ns_recipe.h) in the pass that writes the fp32 result: out = src * sqrt(min(m, n)) /
// max(||src||_F, 1e-6) per matrix; src contiguous (batch, m, n) fp32 or bf16, out contiguous fp32
// of the same shape, possibly src itself. One read of src for the norms, then one read and write.
void frobenius_renorm_out(Tensor& out, const Tensor& src);

// Rounds a contiguous fp32 tensor's values to bf16 in place (they stay fp32 tensors: a bf16 value
// is exact in fp32, so an fp32 product of such values is the bf16 product with an fp32 result,
// which the Gram iteration needs for R and which ATen's CPU bf16 GEMMs cannot write).
void round_bf16_(Tensor& t);

}  // namespace megatron_eopt
