#include "cpu/syrk_cpu.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu/avx512_cpu.h"
#include "megatron_eopt/storage_types.h"
#include "ops/c_export.h"

namespace megatron_eopt {
namespace {

constexpr int64_t kPanel = kSyrkPanelRows;
constexpr int64_t kRows = kSyrkTileRows;

// Row tiles of column panel q: those of rows [0, min(side, 32 (q + 1))).
int64_t row_tiles_of_panel(const SyrkShape& shape, int64_t q) {
  const int64_t rows = std::min(shape.side, kPanel * (q + 1));
  return (rows + kRows - 1) / kRows;
}

uint32_t pair_word(uint16_t low, uint16_t high) {
  return static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16);
}

// One panel of one matrix, portable: out[p * 32 + r] is the panel row r's word of step p (zero
// past its `rows` rows and past the depth). Element strides are in elements of the type.
void pack_panel_scalar(const void* x, int64_t row_stride, int64_t depth_stride, const SyrkShape& shape, int64_t rows,
                       uint32_t* out) {
  const int64_t steps = shape.steps();
  for (int64_t p = 0; p < steps; ++p) {
    for (int64_t r = 0; r < kPanel; ++r) {
      uint32_t word = 0;
      if (r < rows && shape.type == SyrkType::kBf16) {
        const uint16_t* lo = static_cast<const uint16_t*>(x) + 2 * p * depth_stride + r * row_stride;
        word = pair_word(*lo, 2 * p + 1 < shape.depth ? lo[depth_stride] : uint16_t{0});
      } else if (r < rows) {
        word = float_bits(static_cast<const float*>(x)[p * depth_stride + r * row_stride]);
      }
      out[p * kPanel + r] = word;
    }
  }
}

#if MEGATRON_EOPT_AVX512_CODE

// Depth contiguous (rows strided): 16 words of 16 rows at a time, transposed in registers. 16
// words are 32 bf16 or 16 fp32 depth indices; masked loads give zeros past the depth (the high
// half of an odd depth's last bf16 pair included).
MEGATRON_EOPT_AVX512 void pack_depth_contiguous(const void* panel, int64_t row_stride, const SyrkShape& shape,
                                                int64_t rows, uint32_t* out) {
  const bool bf16 = shape.type == SyrkType::kBf16;
  const int64_t steps = shape.steps(), element_bytes = bf16 ? 2 : 4, per_word = bf16 ? 2 : 1;
  const char* base = static_cast<const char*>(panel);
  for (int64_t h = 0; h < kPanel; h += 16) {  // 16 rows at a time: 16 read streams
    for (int64_t p0 = 0; p0 < steps; p0 += 16) {
      const int64_t lanes = bf16 ? 32 : 16, valid = std::min<int64_t>(lanes, shape.depth - per_word * p0);
      const int64_t words = std::min<int64_t>(16, steps - p0);
      const bool full = valid == lanes;
      __m512i v[16];
      for (int64_t r = 0; r < 16; ++r) {
        if (h + r >= rows) {
          v[r] = _mm512_setzero_si512();
          continue;
        }
        const char* at = base + ((h + r) * row_stride + per_word * p0) * element_bytes;
        if (full) v[r] = _mm512_loadu_si512(at);
        else if (bf16) v[r] = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << valid) - 1), at);
        else v[r] = _mm512_maskz_loadu_epi32(static_cast<__mmask16>((1u << valid) - 1), at);
      }
      transpose_16x16(v);
      for (int64_t j = 0; j < words; ++j) _mm512_storeu_si512(out + (p0 + j) * kPanel + h, v[j]);
    }
  }
}

// Rows contiguous (a transposed view), a whole panel: bf16 widens two depth rows of X and
// interleaves them; fp32 copies one.
MEGATRON_EOPT_AVX512 void pack_rows_contiguous(const void* panel, int64_t depth_stride, const SyrkShape& shape,
                                               uint32_t* out) {
  if (shape.type == SyrkType::kFp32) {
    const float* x = static_cast<const float*>(panel);
    for (int64_t p = 0; p < shape.depth; ++p) {
      _mm512_storeu_si512(out + p * kPanel, _mm512_loadu_si512(x + p * depth_stride));
      _mm512_storeu_si512(out + p * kPanel + 16, _mm512_loadu_si512(x + p * depth_stride + 16));
    }
    return;
  }
  const uint16_t* x = static_cast<const uint16_t*>(panel);
  const int64_t full_pairs = shape.depth / 2;
  for (int64_t p = 0; p < full_pairs; ++p) {
    const uint16_t* lo = x + 2 * p * depth_stride;
    const uint16_t* hi = lo + depth_stride;
    for (int64_t h = 0; h < kPanel; h += 16) {
      const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + h)));
      const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + h)));
      _mm512_storeu_si512(out + p * kPanel + h, _mm512_or_si512(l, _mm512_slli_epi32(u, 16)));
    }
  }
  if (full_pairs < shape.steps()) {  // odd depth: the last pair's high half is zero
    for (int64_t r = 0; r < kPanel; ++r) out[full_pairs * kPanel + r] = x[2 * full_pairs * depth_stride + r];
  }
}

// The 8 x 32 tile's products, step by step: rows a (8 consecutive rows of a packed panel),
// columns b (a whole packed panel).
// The accumulators start from `partial` (an 8 x 32 fp32 tile from earlier steps) or zero, and
// live in locals (an array behind a pointer would be reloaded after every store, since vector
// types may alias anything).
MEGATRON_EOPT_AVX512 inline void load_partial(const float* partial, __m512 acc[kRows][2]) {
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = partial ? _mm512_loadu_ps(partial + r * kPanel) : _mm512_setzero_ps();
    acc[r][1] = partial ? _mm512_loadu_ps(partial + r * kPanel + 16) : _mm512_setzero_ps();
  }
}

MEGATRON_EOPT_AVX512_BF16 void accumulate_bf16(const uint32_t* a, const uint32_t* b, int64_t steps,
                                               const float* partial, __m512 out[kRows][2]) {
  __m512 acc[kRows][2];
  load_partial(partial, acc);
  for (int64_t p = 0; p < steps; ++p) {
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
  for (int r = 0; r < kRows; ++r) out[r][0] = acc[r][0], out[r][1] = acc[r][1];
}

// fp32 sums are formed in blocks of kSumSteps depth steps, each from zero, then added to the
// running total: the rounding error of a sum of d products then grows with kSumSteps + d /
// kSumSteps instead of d, which keeps fp32 products at least as close to float64 as ATen's
// GEMMs (a single chain over a 513-deep product was 3x further; tests/python/test_cpu_paths.py).
// The totals live in memory between blocks (16 more registers than AVX-512 has), touched once per
// block.
constexpr int64_t kSumSteps = 32;
// A cache block of the depth is a whole number of summation blocks (see run_tiles).
static_assert(SyrkShape{1, 1, 1, SyrkType::kFp32}.chunk_steps() % kSumSteps == 0, "fp32 chunks split a sum block");

MEGATRON_EOPT_AVX512 void accumulate_fp32(const uint32_t* a, const uint32_t* b, int64_t steps, const float* partial,
                                          __m512 out[kRows][2]) {
  __m512 total[kRows][2];
  load_partial(partial, total);
  for (int64_t p0 = 0; p0 < steps; p0 += kSumSteps) {
    const int64_t p1 = std::min(steps, p0 + kSumSteps);
    __m512 acc[kRows][2];
    load_partial(nullptr, acc);
    for (int64_t p = p0; p < p1; ++p) {
      // The words are read as the integers they were stored as and reinterpreted in registers.
      const __m512 b0 = _mm512_castsi512_ps(_mm512_loadu_si512(b + p * kPanel));
      const __m512 b1 = _mm512_castsi512_ps(_mm512_loadu_si512(b + p * kPanel + 16));
      const uint32_t* ap = a + p * kPanel;
#pragma GCC unroll 8
      for (int r = 0; r < kRows; ++r) {
        const __m512 ar = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(ap[r])));
        acc[r][0] = _mm512_fmadd_ps(ar, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(ar, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      total[r][0] = _mm512_add_ps(total[r][0], acc[r][0]);
      total[r][1] = _mm512_add_ps(total[r][1], acc[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) out[r][0] = total[r][0], out[r][1] = total[r][1];
}

// Rounds 16 fp32 lanes to bf16, nearest even (AVX512-BF16's VCVTNEPS2BF16).
MEGATRON_EOPT_AVX512_BF16 __m256i round_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// Writes a tile's rows (cols of them, elements of T) and, above the diagonal blocks (its columns
// start mirror_offset = j0 - i0 right of its rows), its transpose: c[j0 + j, i0 + r].
template <typename T>
MEGATRON_EOPT_AVX512 void store_tile(const __m512 acc[kRows][2], T* c, int64_t ldc, int64_t rows, int64_t cols,
                                     int64_t mirror_offset) {
  const __mmask16 m0 = static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1);
  const __mmask16 m1 = static_cast<__mmask16>(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1);
  for (int r = 0; r < rows; ++r) {
    T* row = c + r * ldc;
    if constexpr (std::is_same_v<T, uint16_t>) {
      _mm256_mask_storeu_epi16(row, m0, round_to_bf16(acc[r][0]));
      _mm256_mask_storeu_epi16(row + 16, m1, round_to_bf16(acc[r][1]));
    } else {
      _mm512_mask_storeu_ps(row, m0, acc[r][0]);
      _mm512_mask_storeu_ps(row + 16, m1, acc[r][1]);
    }
  }
  if (mirror_offset == 0) return;
  // The transpose from the accumulators, 16 columns at a time: after transpose_16x16 (the 8 rows
  // padded with zeros) vector j starts with column j's 8 values, one 8-wide store each. A copy of
  // the stored elements, one scalar load and store each, took 12% of the tiles' time at 768 x 768
  // fp32. bf16 rounds the same fp32 values with the same instruction: the mirror is bit-equal.
  const __mmask8 row_mask = static_cast<__mmask8>((1u << rows) - 1);
  for (int64_t j0 = 0; j0 < cols; j0 += 16) {
    __m512i v[16];
    for (int r = 0; r < 16; ++r) v[r] = r < kRows ? _mm512_castps_si512(acc[r][j0 / 16]) : _mm512_setzero_si512();
    transpose_16x16(v);
    for (int64_t j = j0; j < std::min<int64_t>(cols, j0 + 16); ++j) {
      T* dst = c + (mirror_offset + j) * ldc - mirror_offset;
      const __m512 column = _mm512_castsi512_ps(v[j - j0]);
      if constexpr (std::is_same_v<T, uint16_t>) {
        _mm_mask_storeu_epi16(dst, row_mask, _mm256_castsi256_si128(round_to_bf16(column)));
      } else {
        _mm256_mask_storeu_ps(dst, row_mask, _mm512_castps512_ps256(column));
      }
    }
  }
}

// Cache blocking, as in any GEMM: the depth is cut into chunks of shape.chunk_steps() steps and
// the rows into blocks of kBlockTiles row tiles. For each chunk and row block, the block's rows
// over the chunk (16 tiles x 8 rows x 128 fp32 or 512 bf16-pair words: 64 or 256 KiB) stay in L2
// while every column panel of the range streams its 32 columns over the chunk (16 or 64 KiB) by.
// Without it each 8-row tile re-read its column panel over the whole depth from L3 or memory
// (1 MiB for a 2048 x 8192 fp32 X), and the tiles ran well below their in-cache rate
// (benchmarks/RESULTS.md). Partial sums are kept exactly in fp32 between chunks, and an fp32
// chunk is a whole number of kSumSteps blocks, so the result does not depend on the blocking.
constexpr int64_t kBlockTiles = 16;

// The row tiles [first, last) of column panel q of matrix b: tasks offset .. offset + last - first
// of a range.
struct TileRun {
  int64_t b, q, first, last, offset;
};

template <typename T>
MEGATRON_EOPT_AVX512 void run_tiles(const uint32_t* packed, const SyrkShape& shape, T* c, float* partials,
                                    int64_t begin, int64_t end) {
  constexpr bool bf16 = std::is_same_v<T, uint16_t>;
  const int64_t per_matrix = shape.tiles_per_matrix(), steps = shape.steps(), side = shape.side;
  // At least one chunk, so that a zero depth still writes its zero tiles.
  const int64_t chunk_steps = shape.chunk_steps(), panel_words = steps * kPanel;
  const int64_t chunks = std::max<int64_t>(1, (steps + chunk_steps - 1) / chunk_steps);
  if (begin >= end) return;
  thread_local std::vector<TileRun> runs;
  runs.clear();
  for (int64_t task = begin; task < end;) {
    const int64_t b = task / per_matrix;
    int64_t first = task % per_matrix, q = 0;
    while (first >= row_tiles_of_panel(shape, q)) first -= row_tiles_of_panel(shape, q++);
    const int64_t last = std::min(row_tiles_of_panel(shape, q), first + (end - task));
    runs.push_back({b, q, first, last, task - begin});
    task += last - first;
  }
  const int64_t row_blocks = (side + kRows * kBlockTiles - 1) / (kRows * kBlockTiles);
  for (std::size_t at = 0; at < runs.size();) {
    std::size_t stop = at;  // runs [at, stop) belong to one matrix
    while (stop < runs.size() && runs[stop].b == runs[at].b) ++stop;
    const int64_t b = runs[at].b;
    const uint32_t* matrix = packed + b * shape.packed_words_per_matrix();
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t s0 = chunk * chunk_steps, n = std::min(chunk_steps, steps - s0);
      for (int64_t block = 0; block < row_blocks; ++block) {
        for (std::size_t k = at; k < stop; ++k) {
          const TileRun& run = runs[k];
          const uint32_t* columns = matrix + run.q * panel_words + s0 * kPanel;
          const int64_t j0 = run.q * kPanel, cols = std::min(kPanel, side - j0);
          const int64_t t_end = std::min(run.last, (block + 1) * kBlockTiles);
          for (int64_t t = std::max(run.first, block * kBlockTiles); t < t_end; ++t) {
            const int64_t i0 = t * kRows;
            const uint32_t* rows = matrix + (i0 / kPanel) * panel_words + i0 % kPanel + s0 * kPanel;
            float* partial = chunks > 1 ? partials + (begin + run.offset + t - run.first) * kRows * kPanel : nullptr;
            __m512 acc[kRows][2];
            if constexpr (bf16) accumulate_bf16(rows, columns, n, chunk > 0 ? partial : nullptr, acc);
            else accumulate_fp32(rows, columns, n, chunk > 0 ? partial : nullptr, acc);
            if (chunk + 1 < chunks) {
              for (int r = 0; r < kRows; ++r) {
                _mm512_storeu_ps(partial + r * kPanel, acc[r][0]);
                _mm512_storeu_ps(partial + r * kPanel + 16, acc[r][1]);
              }
            } else {
              store_tile(acc, c + (b * side + i0) * side + j0, side, std::min(kRows, side - i0), cols,
                         i0 < j0 ? j0 - i0 : 0);
            }
          }
        }
      }
    }
    at = stop;
  }
}

#endif

}  // namespace

int64_t SyrkShape::tiles_per_matrix() const {
  int64_t tiles = 0;
  for (int64_t q = 0; q < panels(); ++q) tiles += row_tiles_of_panel(*this, q);
  return tiles;
}

bool syrk_available(SyrkType type) {
#if MEGATRON_EOPT_AVX512_CODE
  static const bool bf16 = cpu_runs_avx512() && __builtin_cpu_supports("avx512bf16");
  return type == SyrkType::kBf16 ? bf16 : cpu_runs_avx512();
#else
  (void)type;
  return false;
#endif
}

void syrk_pack(const void* x, int64_t batch_stride, int64_t row_stride, int64_t depth_stride, const SyrkShape& shape,
               uint32_t* packed, int64_t begin, int64_t end) {
  const int64_t panels = shape.panels(), panel_words = shape.steps() * kPanel;
  const int64_t element_bytes = shape.type == SyrkType::kBf16 ? 2 : 4;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / panels, i0 = (task % panels) * kPanel, rows = std::min(kPanel, shape.side - i0);
    const void* panel = static_cast<const char*>(x) + (b * batch_stride + i0 * row_stride) * element_bytes;
    uint32_t* out = packed + task * panel_words;
#if MEGATRON_EOPT_AVX512_CODE
    if (syrk_available(SyrkType::kFp32)) {  // AVX-512 F/BW/VL: the packing's instructions
      if (depth_stride == 1) {
        pack_depth_contiguous(panel, row_stride, shape, rows, out);
        continue;
      }
      if (row_stride == 1 && rows == kPanel) {
        pack_rows_contiguous(panel, depth_stride, shape, out);
        continue;
      }
    }
#endif
    pack_panel_scalar(panel, row_stride, depth_stride, shape, rows, out);
  }
}

int64_t SyrkShape::partial_floats() const {
  return steps() > chunk_steps() ? batch * tiles_per_matrix() * kRows * kPanel : 0;
}

void syrk_tiles(const uint32_t* packed, const SyrkShape& shape, void* c, float* partials, int64_t begin, int64_t end) {
#if MEGATRON_EOPT_AVX512_CODE
  if (shape.type == SyrkType::kBf16) run_tiles(packed, shape, static_cast<uint16_t*>(c), partials, begin, end);
  else run_tiles(packed, shape, static_cast<float*>(c), partials, begin, end);
#else
  (void)packed, (void)shape, (void)c, (void)partials, (void)begin, (void)end;
#endif
}

}  // namespace megatron_eopt

// ctypes entry point of megatron_eopt.cpu_symmetric_products: whether W W^T runs on this file's
// kernel for fp32 and for bf16 values (1) or on ATen's GEMMs (0).
MEGATRON_EOPT_C_EXPORT void megatron_eopt_cpu_syrk_kernel(int* fp32, int* bf16) {
  *fp32 = megatron_eopt::syrk_available(megatron_eopt::SyrkType::kFp32) ? 1 : 0;
  *bf16 = megatron_eopt::syrk_available(megatron_eopt::SyrkType::kBf16) ? 1 : 0;
}
