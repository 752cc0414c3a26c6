#include "cpu/syrk_bf16.h"

#include <algorithm>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGATRON_EOPT_SYRK_AVX512 1
#include <immintrin.h>
#define MEGATRON_EOPT_SYRK_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define MEGATRON_EOPT_SYRK_AVX512 0
#endif

namespace megatron_eopt {
namespace {

constexpr int64_t kPanel = kSyrkPanelRows;
constexpr int64_t kRows = kSyrkTileRows;

// Row tiles of column panel q: those of rows [0, min(side, 32 (q + 1))).
int64_t row_tiles_of_panel(const SyrkBf16Shape& shape, int64_t q) {
  const int64_t rows = std::min(shape.side, kPanel * (q + 1));
  return (rows + kRows - 1) / kRows;
}

uint32_t pair_word(uint16_t low, uint16_t high) { return static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16); }

// One panel of one matrix, portable: out[p * 32 + r] holds X[i0 + r, 2p] and X[i0 + r, 2p + 1]
// (zero past the matrix).
void pack_panel_scalar(const uint16_t* x, int64_t row_stride, int64_t depth_stride, int64_t side, int64_t depth,
                       int64_t i0, uint32_t* out) {
  const int64_t pairs = (depth + 1) / 2, rows = std::min(kPanel, side - i0), full_pairs = depth / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* lo = x + 2 * p * depth_stride + i0 * row_stride;
    const bool has_high = p < full_pairs;
    for (int64_t r = 0; r < kPanel; ++r) {
      out[p * kPanel + r] =
          r < rows ? pair_word(lo[r * row_stride], has_high ? lo[r * row_stride + depth_stride] : uint16_t{0}) : 0u;
    }
  }
}

#if MEGATRON_EOPT_SYRK_AVX512

// Transposes 16 x 16 32-bit words in registers: on return v[j] holds word j of the rows v[0..15].
MEGATRON_EOPT_SYRK_TARGET inline void transpose_16x16(__m512i v[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // lane L: rows 2i, 2i + 1 at words 4L, 4L + 1 (lo) and 4L + 2, 4L + 3 (hi)
    a[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // b[4i + c], lane L: word 4L + c of rows 4i .. 4i + 3
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of b[c], b[4 + c], b[8 + c], b[12 + c] into word 4L + c
    const __m512i d0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), d1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);
    const __m512i e0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i e1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    v[c] = _mm512_shuffle_i32x4(d0, e0, 0x88);
    v[8 + c] = _mm512_shuffle_i32x4(d0, e0, 0xDD);
    v[4 + c] = _mm512_shuffle_i32x4(d1, e1, 0x88);
    v[12 + c] = _mm512_shuffle_i32x4(d1, e1, 0xDD);
  }
}

// The same with AVX-512: rows strided and depth contiguous load 16 words (32 depth indices) of
// 16 rows and transpose them in registers; rows contiguous (a transposed view) widen two rows of
// X and interleave them.
MEGATRON_EOPT_SYRK_TARGET void pack_panel(const uint16_t* x, int64_t row_stride, int64_t depth_stride, int64_t side,
                                          int64_t depth, int64_t i0, uint32_t* out) {
  const int64_t pairs = (depth + 1) / 2, rows = std::min(kPanel, side - i0), full_pairs = depth / 2;
  const uint16_t* panel = x + i0 * row_stride;
  if (depth_stride == 1) {
    for (int64_t h = 0; h < kPanel; h += 16) {  // 16 rows at a time: 16 read streams
      for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
        const int64_t valid = std::min<int64_t>(32, depth - 2 * p0), words = std::min<int64_t>(16, pairs - p0);
        // Masked loads past the depth: zeros (the high half of an odd depth's last pair included).
        const __mmask32 mask = valid >= 32 ? ~__mmask32{0} : (__mmask32{1} << valid) - 1;
        __m512i v[16];
        for (int64_t r = 0; r < 16; ++r) {
          const uint16_t* at = panel + (h + r) * row_stride + 2 * p0;
          v[r] = h + r >= rows ? _mm512_setzero_si512()
                 : valid == 32 ? _mm512_loadu_si512(at)
                               : _mm512_maskz_loadu_epi16(mask, at);
        }
        transpose_16x16(v);
        for (int64_t j = 0; j < words; ++j) _mm512_storeu_si512(out + (p0 + j) * kPanel + h, v[j]);
      }
    }
    return;
  }
  if (row_stride == 1 && rows == kPanel) {
    for (int64_t p = 0; p < full_pairs; ++p) {
      const uint16_t* lo = panel + 2 * p * depth_stride;
      const uint16_t* hi = lo + depth_stride;
      for (int64_t h = 0; h < kPanel; h += 16) {
        const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + h)));
        const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + h)));
        _mm512_storeu_si512(out + p * kPanel + h, _mm512_or_si512(l, _mm512_slli_epi32(u, 16)));
      }
    }
    if (full_pairs < pairs) {
      for (int64_t r = 0; r < kPanel; ++r) out[full_pairs * kPanel + r] = panel[2 * full_pairs * depth_stride + r];
    }
    return;
  }
  pack_panel_scalar(x, row_stride, depth_stride, side, depth, i0, out);
}

// One 8 x 32 tile: rows a (8 consecutive rows of a packed panel), columns b (a whole packed panel).
MEGATRON_EOPT_SYRK_TARGET void tile_8x32(const uint32_t* a, const uint32_t* b, int64_t pairs, Bf16* c,
                                         int64_t ldc, int64_t rows, int64_t cols, int64_t mirror_offset) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * kPanel + 16);
    const uint32_t* ap = a + p * kPanel;
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
  const __mmask16 m0 = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1);
  for (int r = 0; r < kRows; ++r) {
    if (r >= rows) break;
    Bf16* row = c + r * ldc;
    const __m256i lo = (__m256i)_mm512_cvtneps_pbh(acc[r][0]);
    const __m256i hi = (__m256i)_mm512_cvtneps_pbh(acc[r][1]);
    if (cols == kPanel) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), hi);
    } else {
      _mm256_mask_storeu_epi16(row, m0, lo);
      _mm256_mask_storeu_epi16(row + 16, m1, hi);
    }
  }
  if (mirror_offset == 0) return;
  // A tile above the diagonal blocks (its columns start mirror_offset = j0 - i0 right of its
  // rows) also writes its transpose: c[j0 + j, i0 + r] = c[i0 + r, j0 + j].
  for (int64_t j = 0; j < cols; ++j) {
    Bf16* dst = c + (mirror_offset + j) * ldc - mirror_offset;
    for (int64_t r = 0; r < rows; ++r) dst[r] = c[r * ldc + j];
  }
}

#endif

}  // namespace

int64_t SyrkBf16Shape::tiles_per_matrix() const {
  int64_t tiles = 0;
  for (int64_t q = 0; q < panels(); ++q) tiles += row_tiles_of_panel(*this, q);
  return tiles;
}

bool syrk_bf16_available() {
#if MEGATRON_EOPT_SYRK_AVX512
  static const bool available = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return available;
#else
  return false;
#endif
}

void syrk_bf16_pack(const Bf16* x, int64_t batch_stride, int64_t row_stride, int64_t depth_stride,
                    const SyrkBf16Shape& shape, uint32_t* packed, int64_t begin, int64_t end) {
  const int64_t panels = shape.panels(), panel_words = shape.pairs() * kPanel;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / panels, q = task % panels;
    const uint16_t* matrix = reinterpret_cast<const uint16_t*>(x) + b * batch_stride;
#if MEGATRON_EOPT_SYRK_AVX512
    if (syrk_bf16_available()) {
      pack_panel(matrix, row_stride, depth_stride, shape.side, shape.depth, q * kPanel, packed + task * panel_words);
      continue;
    }
#endif
    pack_panel_scalar(matrix, row_stride, depth_stride, shape.side, shape.depth, q * kPanel, packed + task * panel_words);
  }
}

void syrk_bf16_tiles(const uint32_t* packed, const SyrkBf16Shape& shape, Bf16* c, int64_t begin, int64_t end) {
#if MEGATRON_EOPT_SYRK_AVX512
  const int64_t per_matrix = shape.tiles_per_matrix(), pairs = shape.pairs(), side = shape.side;
  const int64_t panel_words = pairs * kPanel;
  int64_t task = begin;
  while (task < end) {
    // Locate the task's column panel, then run the rest of that panel's row tiles.
    const int64_t b = task / per_matrix;
    int64_t t = task % per_matrix, q = 0;
    while (t >= row_tiles_of_panel(shape, q)) t -= row_tiles_of_panel(shape, q++);
    const uint32_t* matrix = packed + b * shape.packed_words_per_matrix();
    const uint32_t* columns = matrix + q * panel_words;
    const int64_t j0 = q * kPanel, cols = std::min(kPanel, side - j0);
    for (const int64_t tiles = row_tiles_of_panel(shape, q); t < tiles && task < end; ++t, ++task) {
      const int64_t i0 = t * kRows;
      const uint32_t* rows = matrix + (i0 / kPanel) * panel_words + i0 % kPanel;
      tile_8x32(rows, columns, pairs, c + (b * side + i0) * side + j0, side, std::min(kRows, side - i0), cols,
                i0 < j0 ? j0 - i0 : 0);
    }
  }
#else
  (void)packed, (void)shape, (void)c, (void)begin, (void)end;
#endif
}

}  // namespace megatron_eopt
