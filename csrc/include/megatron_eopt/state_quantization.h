// Low-memory optimizer state: the torch-free element and block math that the CPU loops, the CUDA
// kernels and the GoogleTest suite share, so both backends store the same bits.
//
// Formats (the `state_dtype` option of the optimizers):
//   bf16  every value rounded stochastically to bf16; no scales.
//   int8  blocks of `block_size` consecutive values of one row (the last dimension); per block an
//         fp32 scale = absmax / 127, values stored as round(x / scale) in [-127, 127].
//   fp8   the same blocks, scale = absmax / 448, values stored as float8 e4m3 (the "fn" variant:
//         no infinities, max 448) of x / scale.
// Rounding is stochastic (unbiased: E[stored] = x) with a counter-based hash of (seed, stream,
// element index) as the uniform draw: no RNG state, identical on CPU and CUDA, and a new seed per
// step decorrelates the noise between steps.
// A non-finite value in a block makes the block's scale NaN: the whole block reads back as NaN,
// which is where the fp32 path's NaN ends up anyway (Newton–Schulz mixes every element).
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>

#include "megatron_eopt/host_device.h"
#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

enum class StateFormat : uint8_t { kBFloat16, kInt8, kFloat8E4M3 };

// Raw storage of an fp8 e4m3fn value.
struct Fp8E4M3 {
  uint8_t bits;
};

constexpr float kInt8Max = 127.f;
constexpr float kE4M3Max = 448.f;

// The largest magnitude a block maps onto.
MEGATRON_EOPT_HD float format_max(StateFormat f) { return f == StateFormat::kInt8 ? kInt8Max : kE4M3Max; }

// ---- uniform draws ----
// splitmix64's finalizer: a bijective 64-bit mix with full avalanche.
MEGATRON_EOPT_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// murmur3's 32-bit finalizer: bijective, full avalanche, and in 32-bit multiplies that vectorize.
MEGATRON_EOPT_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// The key of one (step seed, stream) pair: 64 well-mixed bits, computed once per tensor.
MEGATRON_EOPT_HD uint64_t draw_key(uint64_t seed, uint64_t stream) {
  return mix64(seed * 0x9E3779B97F4A7C15ull + mix64(stream + 0x632BE59BD9B4E019ull));
}

// The draw of one element: 32 uniform bits from its stream's key and its index (two rounds of a
// 32-bit mix keyed by both halves of the key, the index's high half folded in).
MEGATRON_EOPT_HD uint32_t element_bits(uint64_t key, uint64_t index) {
  const uint32_t lo = static_cast<uint32_t>(index);
  const uint32_t hi = static_cast<uint32_t>(index >> 32);
  const uint32_t h = mix32(lo ^ static_cast<uint32_t>(key) ^ mix32(hi + 0x27D4EB2Fu));
  return mix32(h + static_cast<uint32_t>(key >> 32));
}

// The draw of one element: a function of the step's seed, the stream (tensor and state kind) and
// the element's index, as 32 uniform bits.
MEGATRON_EOPT_HD uint32_t random_bits(uint64_t seed, uint64_t stream, uint64_t index) {
  return element_bits(draw_key(seed, stream), index);
}

// The top 24 bits as a float in [0, 1): every value is exact, and 1 is never reached.
MEGATRON_EOPT_HD float uniform_from_bits(uint32_t bits) {
  return static_cast<float>(bits >> 8) * 5.9604644775390625e-08f;  // 2^-24
}

// ---- bf16 ----
// Stochastic rounding to bf16: the 16 dropped bits are compared with 16 random bits, so x rounds
// away from zero with probability (dropped part) / ulp. Infinities stay; NaN stays NaN (quiet).
MEGATRON_EOPT_HD Bf16 bf16_stochastic(float x, uint32_t bits) {
  const uint32_t u = float_bits(x);
  const uint32_t rounded = (u + (bits & 0xFFFFu)) >> 16;
  const bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const bool is_inf = (u & 0x7FFFFFFFu) == 0x7F800000u;
  const uint32_t kept = is_inf ? (u >> 16) : rounded;
  return Bf16{static_cast<uint16_t>(is_nan ? ((u >> 16) | 0x0040u) : kept)};
}

// ---- fp8 e4m3fn ----
MEGATRON_EOPT_HD float e4m3_to_float(Fp8E4M3 v) {
  const uint32_t sign = v.bits & 0x80u;
  const uint32_t exponent = (v.bits >> 3) & 0xFu;
  const uint32_t mantissa = v.bits & 0x7u;
  float magnitude;
  if (exponent == 0xFu && mantissa == 0x7u) {
    magnitude = bits_float(0x7FC00000u);  // the format's only NaN
  } else if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * 0.001953125f;  // subnormal: m * 2^-9
  } else {
    magnitude = bits_float(((exponent + 120u) << 23) | (mantissa << 20));  // rebias 7 -> 127
  }
  return sign ? -magnitude : magnitude;
}

// The e4m3 grid spacing around |y| (y finite, |y| <= 448): 2^(e - 3) in binade 2^e, 2^-9 below 2^-6.
MEGATRON_EOPT_HD float e4m3_spacing(float magnitude) {
  int e = static_cast<int>((float_bits(magnitude) >> 23) & 0xFFu) - 127;
  if (e < -6) e = -6;
  return bits_float(static_cast<uint32_t>(e - 3 + 127) << 23);
}

// Encodes an e4m3 grid value (exact: |q| a multiple of its spacing, <= 448).
MEGATRON_EOPT_HD Fp8E4M3 e4m3_encode_exact(float q) {
  const uint32_t sign = (float_bits(q) >> 24) & 0x80u;
  const float magnitude = fabsf(q);
  if (magnitude < 0.015625f) {  // below 2^-6: subnormal, m * 2^-9
    return Fp8E4M3{static_cast<uint8_t>(sign | static_cast<uint32_t>(magnitude * 512.f))};
  }
  const uint32_t u = float_bits(magnitude);
  const uint32_t exponent = ((u >> 23) & 0xFFu) - 120u;  // rebias 127 -> 7
  const uint32_t mantissa = (u >> 20) & 0x7u;
  return Fp8E4M3{static_cast<uint8_t>(sign | (exponent << 3) | mantissa)};
}

// Stochastic rounding of y (|y| <= 448 up to rounding of the scaling; NaN gives NaN) to e4m3:
// the neighbour above with probability (|y| - lower) / spacing, clamped to 448.
MEGATRON_EOPT_HD Fp8E4M3 e4m3_stochastic(float y, float uniform) {
  if (!(fabsf(y) <= kE4M3Max * 1.0001f)) return Fp8E4M3{0x7Fu};  // NaN (inf cannot arrive: see scales)
  const float magnitude = fminf(fabsf(y), kE4M3Max);
  const float spacing = e4m3_spacing(magnitude);
  // magnitude / spacing is exact (a power of two); floor(t + u) rounds up with probability frac(t).
  const float steps = floorf(magnitude / spacing + uniform);
  const float q = fminf(mul_rn(steps, spacing), kE4M3Max);
  return e4m3_encode_exact(y < 0.f ? -q : q);
}

// ---- blocks ----
// A block's scale from its absmax: NaN when the block holds a non-finite value, 0 for a zero block.
struct BlockScale {
  float scale;    // stored: value = q * scale
  float inverse;  // applied before rounding: q ~ x * inverse
};

MEGATRON_EOPT_HD BlockScale block_scale(float absmax, StateFormat format) {
  const float top = format_max(format);
  if (!(absmax <= 3.4028234663852886e38f)) return {bits_float(0x7FC00000u), 0.f};  // inf or NaN
  // Below fp32's smallest normal (2^-126) the block is stored as zeros: top / absmax would
  // overflow, and such values are zero for an optimizer step.
  if (absmax < 1.17549435e-38f) return {0.f, 0.f};
  return {absmax / top, top / absmax};
}

// |x|, with NaN ordered above everything, so a block's absmax is NaN when any value is NaN.
MEGATRON_EOPT_HD float absmax_update(float running, float x) {
  const float a = fabsf(x);
  return (a > running || a != a) ? a : running;
}

// Stochastic int8 code of x in a block: floor(x * inverse + u) in [-127, 127] (E = x * inverse).
MEGATRON_EOPT_HD int8_t int8_stochastic(float x, float inverse, float uniform) {
  const float y = mul_rn(x, inverse);
  const float q = fminf(fmaxf(floorf(y + uniform), -kInt8Max), kInt8Max);
  return static_cast<int8_t>(y == y ? q : 0.f);  // a NaN block (scale NaN) stores 0
}

MEGATRON_EOPT_HD float int8_value(int8_t q, float scale) { return mul_rn(static_cast<float>(q), scale); }
MEGATRON_EOPT_HD float e4m3_value(Fp8E4M3 q, float scale) { return mul_rn(e4m3_to_float(q), scale); }

// Blocks of a tensor whose rows have `row_len` elements: each row is cut into ceil(row_len / B)
// blocks, so a block never spans two rows (nor a shard of the rows).
struct BlockLayout {
  int64_t row_len;
  int64_t block_size;

  MEGATRON_EOPT_HD int64_t blocks_per_row() const { return (row_len + block_size - 1) / block_size; }
  MEGATRON_EOPT_HD int64_t blocks(int64_t numel) const { return row_len == 0 ? 0 : numel / row_len * blocks_per_row(); }
  // Flat element range [begin, end) of block b.
  MEGATRON_EOPT_HD void range(int64_t b, int64_t& begin, int64_t& end) const {
    const int64_t per_row = blocks_per_row();
    const int64_t row = b / per_row;
    const int64_t col = (b - row * per_row) * block_size;
    begin = row * row_len + col;
    end = begin + (row_len - col < block_size ? row_len - col : block_size);
  }
};

// Streams of the uniform draws: the momentum and the second moment of one tensor never share one.
MEGATRON_EOPT_HD uint64_t draw_stream(uint64_t tensor_index, uint64_t kind) { return tensor_index * 2u + kind; }

}  // namespace megatron_eopt
