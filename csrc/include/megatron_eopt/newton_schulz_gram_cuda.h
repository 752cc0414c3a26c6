// Host launcher of the Gram Newton–Schulz iteration on CUDA (docs/design.md §4.4). Raw pointers and a
// stream only: the torch glue owns allocation, checks and device selection.
#pragma once

#include <cstddef>
#include <cstdint>

#include "megatron_eopt/blas_context.h"
#include "megatron_eopt/ns_gram_plan.h"
#include "megatron_eopt/ns_precision.h"
#include "megatron_eopt/ns_recipe.h"

namespace megatron_eopt {

// Floats of per-block norm partials the first pass needs (see gram_scratch_layout).
int64_t ns_gram_norm_partial_slots(int64_t batch, int64_t m, int64_t n);

// out[b] = NS(x[b]) for b < batch by running `program` (built for m, n, transpose and precision);
// x and out are fp32 and contiguous, (m x n) row-major each. `scratch` is one allocation laid
// out by gram_scratch_layout(program, batch, m, n, ns_gram_norm_partial_slots(...)).
// `recipe` is folded into the first pass (normalization, MuonEq: `row_scales` holds batch * m
// floats then, else may be null) and Muon+ rescales the result in place.
// No host synchronisation; everything is enqueued on `blas.stream`.
void newton_schulz_gram_cuda(const float* x, float* out, int64_t batch, int64_t m, int64_t n,
                             const GramProgram& program, float eps, const NsRecipe& recipe, NsPrecision precision,
                             void* scratch, const GramScratchLayout& layout, float* row_scales, const LtContext& blas);

}  // namespace megatron_eopt
