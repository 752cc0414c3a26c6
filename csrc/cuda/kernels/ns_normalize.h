// First and last passes of both Newton–Schulz algorithms on CUDA: per-matrix Frobenius norm
// (deterministic, no atomics) and the normalized copy of x in the compute type, with the 2026
// recipe folded in (ns_recipe.h); Muon+ on the result. Torch-free.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "megatron_eopt/ns_recipe.h"

namespace megatron_eopt {

// Floats of the `partials` scratch ns_normalize_cast and ns_frobenius_renorm need for `batch`
// matrices of `elems` each.
int64_t ns_norm_partial_slots(int64_t batch, int64_t elems);

// out[b, i, j] = x[b, i, j] / max(||x[b]||_F, eps), stored as fp32 or (out_bf16) bf16; x and out
// are contiguous (batch, m, n). With a recipe the denominator follows its convention and divisor,
// and with MuonEq row i is multiplied by its factor over the equilibrated matrix's denominator
// instead (row_scales: batch * m floats of scratch, only then read or written). `partials` has
// ns_norm_partial_slots(batch, m * n) floats, `sum_squares` batch floats. Enqueued on `stream`,
// no host synchronisation.
void ns_normalize_cast(const float* x, void* out, bool out_bf16, int64_t batch, int64_t m, int64_t n, float eps,
                       const NsRecipe& recipe, float* partials, float* sum_squares, float* row_scales,
                       cudaStream_t stream);

// Muon+: out[b] = src[b] * sqrt(min(m, n)) / max(||src[b]||_F, 1e-6), src contiguous (batch, m, n)
// fp32 or (src_bf16) bf16, out fp32 (may be src when fp32). One reduction pass over src, then one
// pass that reads src and writes out (for a bf16 src, the cast to fp32 the result needs anyway).
// Scratch as ns_normalize_cast's.
void ns_frobenius_renorm(const void* src, bool src_bf16, float* out, int64_t batch, int64_t m, int64_t n,
                         float* partials, float* sum_squares, cudaStream_t stream);

}  // namespace megatron_eopt
