// Host launcher of the batched Newton–Schulz iteration on CUDA. Raw pointers and a stream only:
// the torch glue owns allocation, checks and device selection.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "megatron_eopt/blas_context.h"
#include "megatron_eopt/ns_precision.h"
#include "megatron_eopt/ns_recipe.h"
#include "megatron_eopt/ns_schedule.h"
#include "megatron_eopt/ns_scratch_layout.h"

namespace megatron_eopt {

// Scratch of one call. The iterate ping-pongs between `iterate[0]` and `iterate[1]` (batch*m*n
// elements of the compute type each); the launcher arranges the steps so the last one writes
// `iterate[0]`, so with fp32 compute the caller passes `out` there and saves a copy.
struct NsScratch {
  void* iterate[2];
  // batch * g * padded_square_ld(g) elements of the compute type each, g = Gram side. They may lie
  // in `out`'s storage when out is x (ns_products_fit_in_input): nothing reads x or out between
  // the first pass and the last, and the last pass writes all of out from iterate[0] only. A
  // recipe option that reads x or out in the last pass must keep them apart (glue's choice).
  void* gram;
  void* poly;
  float* sum_squares;    // batch floats
  float* norm_partials;  // per-block partial sums of squares (ns_norm_partial_slots of them)
  float* row_scales;     // batch * m floats with MuonEq (recipe.row_equilibration), else unused
};

// The layout of one call's scratch (ns_scratch_layout with this library's normalization slots).
// `result_over_input`: `out` is `x` (the in-place op), so G and B may use x's storage.
NsScratchLayout ns_cuda_scratch_layout(int64_t batch, int64_t m, int64_t n, bool transpose, NsPrecision precision,
                                       bool result_over_input);

// out[b] = NS(x[b]) for b < batch; x and out are fp32 and contiguous, (m x n) row-major each. out
// may be x where cuda_result_may_overwrite_input allows (the normalization then writes a buffer
// other than x, which it reads).
// `recipe` is folded into the first pass (normalization, MuonEq) and the last (Muon+).
// No host synchronisation; everything is enqueued on `blas.stream`.
void newton_schulz_cuda(const float* x, float* out, int64_t batch, int64_t m, int64_t n, bool transpose,
                        const std::vector<NsCoefficients>& schedule, float eps, const NsRecipe& recipe,
                        NsPrecision precision, const NsScratch& scratch, const LtContext& blas);

}  // namespace megatron_eopt
