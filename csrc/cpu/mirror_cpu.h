// The mirror of a symmetric product computed on its lower column panels (symmetric_gemm_out in
// batched_gemm.cpp): the elements above the diagonal blocks are copied from their transposes below.
// Torch-free, so that the GoogleTest suite runs both paths.
#pragma once

#include <cstdint>

namespace megatron_eopt {

// d[r][c] = d[c][r] for the rows r in [r_begin, r_end) and the columns c in [from[r], side), in an
// s x s matrix of 2- or 4-byte elements (element_bytes; copied as bits) with row stride ld.
// from[r] must lie past r's diagonal block, which the caller has computed: every source element
// d[c][r] lies below the blocks that are written. Where the CPU runs AVX-512 (cpu_runs_avx512) the
// copy goes through 16 x 16 transposes in registers, unless `portable` asks for the loops every CPU
// runs, in tiles that keep their reads in the L1 cache. Both copy the same bits.
void mirror_above_blocks_rows(void* d, int64_t element_bytes, int64_t ld, int64_t side, const int64_t* from,
                              int64_t r_begin, int64_t r_end, bool portable = false);

}  // namespace megatron_eopt
