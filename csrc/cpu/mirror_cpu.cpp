#include "cpu/mirror_cpu.h"

#include <algorithm>
#include <type_traits>

#include "cpu/avx512_cpu.h"

namespace megatron_eopt {
namespace {

// Portable: in tiles of kTile columns, whose reads (kTile columns of as many source rows) stay in
// the L1 cache while the rows are written contiguously. ATen's strided copy of the transposed view
// walks the source a whole row apart per element.
constexpr int64_t kTile = 32;

template <typename Bits>
void mirror_rows_portable(Bits* d, int64_t ld, int64_t s, const int64_t* from, int64_t r_begin, int64_t r_end) {
  for (int64_t cb = from[r_begin]; cb < s; cb += kTile) {  // rows further down copy less
    for (int64_t r = r_begin; r < r_end; ++r) {
      Bits* row = d + r * ld;
      const int64_t stop = std::min(cb + kTile, s);
      for (int64_t c = std::max(cb, from[r]); c < stop; ++c) row[c] = d[c * ld + r];
    }
  }
}

#if MEGATRON_EOPT_AVX512_CODE

// Rows [r0, r0 + rows) x columns [c0, c0 + cols) of d from their transposes, rows and cols at most
// 16: the source's rows load (masked) into 16 vectors of 32-bit words (bf16 widened), transpose in
// registers and store (narrowed) as the destination's rows. Masked lanes neither read nor write.
template <typename Bits>
MEGATRON_EOPT_AVX512 void mirror_tile(Bits* d, int64_t ld, int64_t r0, int64_t rows, int64_t c0, int64_t cols) {
  const __mmask16 row_lanes = static_cast<__mmask16>((1u << rows) - 1);
  const __mmask16 col_lanes = static_cast<__mmask16>((1u << cols) - 1);
  __m512i v[16];
  for (int64_t k = 0; k < 16; ++k) {
    if (k >= cols) {
      v[k] = _mm512_setzero_si512();
      continue;
    }
    const Bits* src = d + (c0 + k) * ld + r0;
    if constexpr (std::is_same_v<Bits, uint16_t>)
      v[k] = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(row_lanes, src));
    else v[k] = _mm512_maskz_loadu_epi32(row_lanes, src);
  }
  transpose_16x16(v);
  for (int64_t k = 0; k < rows; ++k) {
    Bits* dst = d + (r0 + k) * ld + c0;
    if constexpr (std::is_same_v<Bits, uint16_t>) _mm256_mask_storeu_epi16(dst, col_lanes, _mm512_cvtepi32_epi16(v[k]));
    else _mm512_mask_storeu_epi32(dst, col_lanes, v[k]);
  }
}

// Runs of rows with one start column (at most two in a caller's 32-row range: blocks are at least
// 256 rows), each in 16 x 16 tiles, the tiles of a column range next to each other so that their
// reads share cache lines.
template <typename Bits>
MEGATRON_EOPT_AVX512 void mirror_rows_avx512(Bits* d, int64_t ld, int64_t s, const int64_t* from, int64_t r_begin,
                                             int64_t r_end) {
  for (int64_t ra = r_begin; ra < r_end;) {
    int64_t rb = ra + 1;
    while (rb < r_end && from[rb] == from[ra]) ++rb;
    for (int64_t c0 = from[ra]; c0 < s; c0 += 16) {
      for (int64_t r0 = ra; r0 < rb; r0 += 16) {
        mirror_tile(d, ld, r0, std::min<int64_t>(16, rb - r0), c0, std::min<int64_t>(16, s - c0));
      }
    }
    ra = rb;
  }
}

#endif

template <typename Bits>
void mirror_rows(Bits* d, int64_t ld, int64_t s, const int64_t* from, int64_t r_begin, int64_t r_end, bool portable) {
  if (r_begin >= r_end) return;
#if MEGATRON_EOPT_AVX512_CODE
  if (!portable && cpu_runs_avx512()) {
    mirror_rows_avx512(d, ld, s, from, r_begin, r_end);
    return;
  }
#endif
  (void)portable;
  mirror_rows_portable(d, ld, s, from, r_begin, r_end);
}

}  // namespace

void mirror_above_blocks_rows(void* d, int64_t element_bytes, int64_t ld, int64_t side, const int64_t* from,
                              int64_t r_begin, int64_t r_end, bool portable) {
  if (element_bytes == 2) mirror_rows(static_cast<uint16_t*>(d), ld, side, from, r_begin, r_end, portable);
  else mirror_rows(static_cast<uint32_t*>(d), ld, side, from, r_begin, r_end, portable);
}

}  // namespace megatron_eopt
