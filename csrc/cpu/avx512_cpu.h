// AVX-512 code of the CPU kernels: compiled with a function target on x86-64 (GCC, clang), run
// only where cpu_runs_avx512() says the CPU has the extensions (F, BW, VL); the portable code runs
// elsewhere. Torch-free.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MEGATRON_EOPT_AVX512_CODE 1
#include <immintrin.h>
#define MEGATRON_EOPT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define MEGATRON_EOPT_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define MEGATRON_EOPT_AVX512_CODE 0
#endif

namespace megatron_eopt {

// Whether this CPU runs the AVX-512 F/BW/VL code.
inline bool cpu_runs_avx512() {
#if MEGATRON_EOPT_AVX512_CODE
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
#else
  return false;
#endif
}

#if MEGATRON_EOPT_AVX512_CODE
// Transposes 16 x 16 32-bit words in registers: on return v[j] holds word j of the rows v[0..15].
MEGATRON_EOPT_AVX512 inline void transpose_16x16(__m512i v[16]) {
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

#endif

}  // namespace megatron_eopt
