// Low-memory optimizer state: the torch-free element and block math that the CPU loops, the CUDA
// kernels and the GoogleTest suite share, so both backends store the same bits.
//
// Formats (the `state_dtype` option of the optimizers):
//   bf16  every value rounded stochastically to bf16; no scales.
//   int8  blocks of `block_size` consecutive values of one row (the last dimension); per block an
//         fp32 scale = absmax / 127, values stored as round(x / scale) in [-127, 127].
//   fp8   the same blocks, codes in float8 e4m3 (the "fn" variant: no infinities, max 448), read
//         in one of two ways:
//         squared (the momentum): a code holds (|x| / scale)^2 with x's sign, scale = absmax /
//           sqrt(448), so value = sign * sqrt(e4m3) * scale. e4m3 alone spaces its values 6-12.5%
//           apart over 17 binades: far more range than a block of momentum needs, and a grid whose
//           rounding noise, carried step to step by the momentum's EMA, costs measurable training
//           quality. Squared codes halve the spacing (3-6% from 1/128 of the block's max up) and
//           reach down to 1/479 of it (9 binades). sqrt is correctly rounded on both backends
//           (same bits).
//         linear (AdaMuon's sqrt(v), which needs the range): scale = absmax / 448, value = e4m3 * scale.
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

enum class StateFormat : uint8_t { kBFloat16, kInt8, kFloat8E4M3, kFloat8E4M3Squared };

// Raw storage of an fp8 e4m3fn value.
struct Fp8E4M3 {
  uint8_t bits;
};

constexpr float kInt8Max = 127.f;
constexpr float kE4M3Max = 448.f;
constexpr float kE4M3MaxRoot = 21.166010488516726f;  // sqrt(448), rounded to nearest: what sqrtf(448) gives

// The largest magnitude a block maps onto.
MEGATRON_EOPT_HD float format_max(StateFormat f) {
  return f == StateFormat::kInt8 ? kInt8Max : (f == StateFormat::kFloat8E4M3Squared ? kE4M3MaxRoot : kE4M3Max);
}

// Comparisons on floats may raise FP exceptions, so compilers keep them as branches inside loops
// (-ftrapping-math); the code below compares bit patterns as integers instead, which if-converts
// and vectorizes. For non-negative floats the integer order of the bits is the numeric order,
// with every NaN above infinity.
MEGATRON_EOPT_HD bool is_nan_bits(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
// floor(x) for |x| < 2^31 as an int32: truncation, minus one where it rounded up (negative x).
// (floorf vectorizes only without -ftrapping-math; this does everywhere.)
MEGATRON_EOPT_HD int32_t floor_to_int(float x) {
  const int32_t t = static_cast<int32_t>(x);
  return t - static_cast<int32_t>(static_cast<float>(t) > x);
}

// |x| as ordered bits: for non-negative floats the integer order is the numeric order, and every
// NaN lies above infinity, whatever its sign bit. Integer compares of these keys vectorize.
MEGATRON_EOPT_HD uint32_t absmax_key(float x) { return float_bits(x) & 0x7FFFFFFFu; }

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
  return static_cast<float>(static_cast<int32_t>(bits >> 8)) * 5.9604644775390625e-08f;  // 2^-24
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
// Every function below is branch-free (selects and bit operations), so the CPU loops over them
// vectorize; the CUDA kernels run the same code.
MEGATRON_EOPT_HD float e4m3_to_float(Fp8E4M3 v) {
  const uint32_t b = v.bits;
  const uint32_t exponent = (b >> 3) & 0xFu;
  const uint32_t mantissa = b & 0x7u;
  // Normal codes rebias the exponent (7 -> 127). A subnormal m * 2^-9 is (1 + m/8) * 2^-6 - 2^-6:
  // both operands are picked by integer selects and the one subtraction (exact) always runs.
  const bool subnormal = exponent == 0;
  const uint32_t base = subnormal ? (0x3C800000u | (mantissa << 20)) : (((exponent + 120u) << 23) | (mantissa << 20));
  const uint32_t offset = subnormal ? 0x3C800000u : 0u;  // 2^-6 or 0
  const float magnitude = bits_float(base) - bits_float(offset);
  // The format's only NaN (0x7F / 0xFF): OR-ed in as a mask (a select here becomes a branch).
  const uint32_t nan = (0u - static_cast<uint32_t>((b & 0x7Fu) == 0x7Fu)) & 0x7FC00000u;
  return bits_float(float_bits(magnitude) | nan | ((b & 0x80u) << 24));
}

// Stochastic rounding of y (|y| <= 448 up to the rounding of the scaling; NaN gives NaN) to an
// e4m3 code, in integer operations on y's bits: above 2^-6 the e4m3 grid is fp32 with its low 20
// mantissa bits cleared, so adding 20 random bits there and truncating rounds up with probability
// (dropped part) / spacing; below 2^-6 the grid is m * 2^-9, and the same is done on |y| * 2^9 in
// fixed point with 20 fraction bits. Results past 448 clamp to 448.
MEGATRON_EOPT_HD Fp8E4M3 e4m3_stochastic(float y, uint32_t bits) {
  const uint32_t yb = float_bits(y);
  const uint32_t u = yb & 0x7FFFFFFFu;
  const uint32_t sign = (yb >> 24) & 0x80u;
  const uint32_t noise = bits & 0xFFFFFu;
  const uint32_t rounded = (u + noise) & 0xFFF00000u;
  const uint32_t normal = rounded > 0x43E00000u ? 0x7Eu  // 448
                                                : ((((rounded >> 23) - 120u) << 3) | ((rounded >> 20) & 0x7u));
  const uint32_t exponent = u >> 23;
  const uint32_t shift = exponent >= 90u ? 121u - exponent : 31u;  // |y| * 2^29 = significand >> shift
  const uint32_t fixed = ((u & 0x7FFFFFu) | 0x800000u) >> (shift > 31u ? 31u : shift);
  const uint32_t subnormal = (fixed + noise) >> 20;  // 0..8 (8 is the code of 2^-6)
  const uint32_t code = sign | (u < 0x3C800000u ? subnormal : normal);
  return Fp8E4M3{static_cast<uint8_t>(u > 0x7F800000u ? 0x7Fu : code)};  // NaN stays NaN
}

// ---- fp8 squared codes (the momentum) ----
// |a| < |b|, NaN above everything, as an integer compare of absmax keys.
MEGATRON_EOPT_HD bool below_bits(float a, float b) { return absmax_key(a) < absmax_key(b); }

// The magnitude a squared code (sign bit clear) stands for, in units of the block scale:
// sqrt(e4m3). 0x7F (NaN) gives NaN.
MEGATRON_EOPT_HD float e4m3_root(uint32_t code) { return sqrtf(e4m3_to_float(Fp8E4M3{static_cast<uint8_t>(code)})); }

// Stochastic rounding of x to a squared code in a block (inverse = sqrt(448) / absmax): t = |x| *
// inverse is rounded to one of its two neighbours r_c <= t < r_{c+1} on the grid r_c =
// e4m3_root(c), up with probability (t - r_c) / (r_{c+1} - r_c), so E[stored value] = x. The
// neighbours come from truncating t^2 to the e4m3 grid (two square roots per value, not four for
// an exact search): where rounding t^2 crosses a grid value, t lies within 2 ulp of that grid
// value and is stored as it, 2 ulp off unbiased where the grid spacing is 2^18 ulp or more. A NaN
// block (scale NaN, inverse 0) stores 0; values past the top stay at 0x7E (its upper neighbour is
// NaN, which no compare picks).
MEGATRON_EOPT_HD Fp8E4M3 e4m3_squared_stochastic(float x, float inverse, float uniform) {
  const uint32_t sign = (float_bits(x) >> 24) & 0x80u;
  float t = mul_rn(bits_float(float_bits(x) & 0x7FFFFFFFu), inverse);
  t = bits_float(is_nan_bits(t) ? 0u : float_bits(t));
  uint32_t c = e4m3_stochastic(mul_rn(t, t), 0u).bits;  // no noise: truncation (clamped at 448)
  const float lo = e4m3_root(c);
  const float gap = e4m3_root(c + 1u) - lo;
  // up when (1 - u) * gap <= t - lo: probability (t - lo) / gap, and draw 0 rounds down as in the
  // other formats (1 - u is exact for the 24-bit draws). t a hair below lo (below_bits compares
  // magnitudes, so t - lo < 0 is tested apart) stays at c, a hair past the upper neighbour goes up.
  c += static_cast<uint32_t>(!below_bits(t, lo) & !below_bits(t - lo, mul_rn(1.f - uniform, gap)));
  return Fp8E4M3{static_cast<uint8_t>(sign | c)};
}

MEGATRON_EOPT_HD float e4m3_squared_value(Fp8E4M3 q, float scale) {
  const float magnitude = e4m3_root(q.bits & 0x7Fu);
  return mul_rn(bits_float(float_bits(magnitude) | ((static_cast<uint32_t>(q.bits) & 0x80u) << 24)), scale);
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

// The block's absmax from the keys of its values (absmax_key): the largest key is the absmax, NaN
// when any value is NaN. An integer max, which vectorizes.
MEGATRON_EOPT_HD uint32_t absmax_key_update(uint32_t running, float x) {
  const uint32_t k = absmax_key(x);
  return k > running ? k : running;
}
MEGATRON_EOPT_HD float absmax_from_key(uint32_t key) { return bits_float(key); }

// The same on floats (|x|, NaN above everything).
MEGATRON_EOPT_HD float absmax_update(float running, float x) {
  return absmax_from_key(absmax_key_update(absmax_key(running), x));
}

// Stochastic int8 code of x in a block: floor(x * inverse + u) in [-127, 127] (E = x * inverse).
MEGATRON_EOPT_HD int8_t int8_stochastic(float x, float inverse, float uniform) {
  float y = mul_rn(x, inverse);
  y = bits_float(is_nan_bits(y) ? 0u : float_bits(y));  // a NaN block (scale NaN) stores 0
  // |y| <= 127 up to the rounding of the scaling, so the conversion is exact and in range.
  const int32_t q = floor_to_int(y + uniform);
  return static_cast<int8_t>(q < -127 ? -127 : (q > 127 ? 127 : q));
}

MEGATRON_EOPT_HD float int8_value(int8_t q, float scale) {
  return mul_rn(static_cast<float>(static_cast<int32_t>(q)), scale);
}
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
// `tensor_key` is the caller's stable id of the tensor's parameter (the optimizers pass the
// parameter's position in their param groups), or the tensor's position in the op's list.
MEGATRON_EOPT_HD uint64_t draw_stream(uint64_t tensor_key, uint64_t kind) { return tensor_key * 2u + kind; }

// Where the elements of a tensor lie in the whole parameter they belong to, so that each element's
// draw is keyed by its index in the whole parameter: a shard, a chunk of the step or the whole
// tensor then draw the same bits for the same element, and two shards never share draws.
// The tensor's rows (row_len values each, BlockLayout's rows) form matrices of `local_rows` rows;
// matrix k's row r and column c lie at row r, column c of matrix k of a stack of
// (global_rows, global_cols) matrices, offset by `base` elements (the shard's first element).
// local_rows == 0: the identity (element i draws at index i).
struct DrawIndex {
  int64_t local_rows = 0;
  int64_t global_rows = 0;
  int64_t global_cols = 0;
  int64_t base = 0;

  // The index of local element i (0 <= i < numel); a block's elements, which lie in one row, are
  // consecutive: of(begin) + j.
  MEGATRON_EOPT_HD uint64_t of(int64_t i, int64_t row_len) const {
    if (local_rows <= 0 || row_len <= 0) return static_cast<uint64_t>(i);
    const int64_t row = i / row_len;
    const int64_t col = i - row * row_len;
    const int64_t matrix = row / local_rows;
    const int64_t r = row - matrix * local_rows;
    return static_cast<uint64_t>(base + (matrix * global_rows + r) * global_cols + col);
  }
};

}  // namespace megatron_eopt
