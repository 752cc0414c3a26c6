#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "megatron_eopt/momentum_math.h"

using namespace megatron_eopt;

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(from_float<Bf16>(1.0f).bits, 0x3F80);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1).
  EXPECT_EQ(from_float<Bf16>(1.00390625f).bits, 0x3F80);
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to 1 + 2^-6.
  EXPECT_EQ(from_float<Bf16>(1.01171875f).bits, 0x3F82);
  EXPECT_EQ(from_float<Bf16>(-2.0f).bits, 0xC000);
  EXPECT_EQ(from_float<Bf16>(std::numeric_limits<float>::quiet_NaN()).bits, 0x7FC0);
  EXPECT_TRUE(std::isinf(to_float(from_float<Bf16>(std::numeric_limits<float>::max()))));
  EXPECT_FLOAT_EQ(to_float(Bf16{0x4049}), 3.140625f);
  EXPECT_FLOAT_EQ(round_to<Bf16>(3.14159f), 3.140625f);
  EXPECT_FLOAT_EQ(round_to<float>(3.14159f), 3.14159f);
}

TEST(MomentumMath, TorchLerpFormulaOnEachSideOfHalf) {
  // weight < 0.5: start + w (end - start); weight >= 0.5: end - (1 - w)(end - start).
  EXPECT_FLOAT_EQ(torch_lerp(1.f, 3.f, 0.25f), 1.5f);
  EXPECT_FLOAT_EQ(torch_lerp(1.f, 3.f, 0.75f), 2.5f);
  EXPECT_EQ(torch_lerp(1.f, 3.f, 1.f), 3.f);  // exact at the end point
  EXPECT_EQ(torch_lerp(1.f, 3.f, 0.f), 1.f);
  const float start = 0.1f, end = 1e8f, w = 0.9f;
  EXPECT_EQ(torch_lerp(start, end, w), std::fmaf(w - 1.f, end - start, end));
}

TEST(MomentumMath, EmaAndNesterov) {
  const MomentumCoefficients plain{0.1f, 0.9f, false, 1.f};
  const MomentumResult r = momentum_element<float, float, false>(2.f, 0.f, 0.f, 1.f, plain);
  EXPECT_FLOAT_EQ(r.buffer, 1.1f);
  EXPECT_EQ(r.ns_input, r.buffer);
  const MomentumCoefficients nesterov{0.1f, 0.9f, true, 1.f};
  const MomentumResult n = momentum_element<float, float, false>(2.f, 0.f, 0.f, 1.f, nesterov);
  EXPECT_FLOAT_EQ(n.ns_input, 2.f + 0.9f * (1.1f - 2.f));
}

TEST(MomentumMath, L2DecayGoesIntoTheGradient) {
  const MomentumCoefficients c{0.5f, 0.5f, false, 1.f};
  // g = 1 + 0.5 * 4 = 3; M = 1 + 0.5 (3 - 1) = 2.
  EXPECT_FLOAT_EQ((momentum_element<float, float, true>(1.f, 4.f, 0.5f, 1.f, c).buffer), 2.f);
  // Without l2 the parameter is ignored.
  EXPECT_FLOAT_EQ((momentum_element<float, float, false>(1.f, 4.f, 0.5f, 1.f, c).buffer), 1.f);
}

TEST(MomentumMath, Bf16StorageRoundsTheBufferAndTheNesterovInput) {
  const MomentumCoefficients c{0.05f, 0.95f, true, 1.f};
  const float g = 0.3f, m = -0.7f;
  const MomentumResult r = momentum_element<Bf16, Bf16, false>(g, 0.f, 0.f, m, c);
  EXPECT_EQ(r.buffer, round_to<Bf16>(torch_lerp(m, g, 0.05f)));
  EXPECT_EQ(r.ns_input, round_to<Bf16>(torch_lerp(g, r.buffer, 0.95f)));
  // fp32 buffers of bf16 gradients keep the Nesterov input in fp32.
  const MomentumResult w = momentum_element<Bf16, float, false>(g, 0.f, 0.f, m, c);
  EXPECT_EQ(w.ns_input, torch_lerp(g, w.buffer, 0.95f));
}

TEST(MomentumMath, WeightDecayFactors) {
  EXPECT_FLOAT_EQ(weight_decay_factor(WeightDecayMethod::kDecoupled, 0.5f, 0.1f), 0.05f);
  EXPECT_FLOAT_EQ(weight_decay_factor(WeightDecayMethod::kIndependent, 0.5f, 0.1f), 0.1f);
  EXPECT_FLOAT_EQ(weight_decay_factor(WeightDecayMethod::kPalm, 0.5f, 0.1f), 0.025f);
  EXPECT_EQ(weight_decay_factor(WeightDecayMethod::kL2, 0.5f, 0.1f), 0.f);
  EXPECT_EQ(parse_weight_decay_method("palm"), WeightDecayMethod::kPalm);
  EXPECT_EQ(parse_weight_decay_method("l2"), WeightDecayMethod::kL2);
  EXPECT_EQ(parse_weight_decay_method("cautious"), WeightDecayMethod::kCautious);
  EXPECT_EQ(weight_decay_factor(WeightDecayMethod::kCautious, 0.5, 0.1),
            weight_decay_factor(WeightDecayMethod::kDecoupled, 0.5, 0.1));
  EXPECT_THROW(parse_weight_decay_method("adamw"), std::invalid_argument);
}

TEST(MomentumMath, UpdateDecaysThenSteps) {
  // p1 = 2 - 0.25 * 2 = 1.5; p = 1.5 - 0.5 * (3 * 1) = 0.
  EXPECT_FLOAT_EQ(update_element<float>(2.f, 1.f, 3.f, 0.25f, 0.5f), 0.f);
  // No decay leaves p exact before the step.
  EXPECT_EQ(update_element<float>(0.1f, 0.f, 1.f, 0.f, 0.5f), 0.1f);
  // bf16 parameters store the decayed value (rounded) before the update, as the reference does.
  const float p = 1.f, decay = 1e-3f;
  EXPECT_EQ(update_element<Bf16>(p, 0.f, 1.f, decay, 0.1f), round_to<Bf16>(std::fmaf(p, -decay, p)));
}

TEST(MomentumMath, CautiousDecayOnlyWhereUpdateAndParamAgreeInSign) {
  const float decay = 0.25f, lr = 0.5f;
  // U·p > 0: p1 = 2 - 0.25 * 2 = 1.5, then p = 1.5 - 0.5 * (3 * 1) = 0 (as decoupled).
  EXPECT_EQ((update_element<float, true>(2.f, 1.f, 3.f, decay, lr)), 0.f);
  EXPECT_EQ((update_element<float, true>(2.f, 1.f, 3.f, decay, lr)),
            (update_element<float, false>(2.f, 1.f, 3.f, decay, lr)));
  // U·p < 0: no decay, only the step: p = 2 - 0.5 * (3 * -1) = 3.5.
  EXPECT_EQ((update_element<float, true>(2.f, -1.f, 3.f, decay, lr)), 3.5f);
  EXPECT_EQ((update_element<float, true>(-2.f, 1.f, 3.f, decay, lr)), -3.5f);
  // Both negative agree in sign: decayed.
  EXPECT_EQ((cautious_decay_element<float>(-2.f, -1.f, decay)), -1.5f);
  // U = 0 or p = 0: U·p = 0 >= 0, decayed (a zero p stays zero).
  EXPECT_EQ((cautious_decay_element<float>(2.f, 0.f, decay)), 1.5f);
  EXPECT_EQ((cautious_decay_element<float>(0.f, -1.f, decay)), 0.f);
  // The mask reads U before its scale: a scale of 0 (decay alone) still masks by U's sign.
  EXPECT_EQ((update_element<float, true>(2.f, -1.f, 0.f, decay, lr)), 2.f);
  EXPECT_EQ((update_element<float, true>(2.f, 1.f, 0.f, decay, lr)), 1.5f);
  // A NaN update masks nothing in (NaN·p >= 0 is false): p is not decayed.
  EXPECT_EQ((cautious_decay_element<float>(2.f, std::numeric_limits<float>::quiet_NaN(), decay)), 2.f);
  // An infinite p whose mask is off gives NaN, as torch's p * 0 does in the reference.
  EXPECT_TRUE(std::isnan(cautious_decay_element<float>(std::numeric_limits<float>::infinity(), -1.f, decay)));
}

TEST(MomentumMath, CautiousDecayRoundsLikeTheSeparateTorchOps) {
  // The reference: p.sub_(p * keep * f.to(p.dtype)): f rounded to p's type, the product rounded,
  // then the difference rounded; never one fused multiply-add.
  uint32_t state = 7u;
  for (int k = 0; k < 20000; ++k) {
    state = state * 1664525u + 1013904223u;
    const float p = static_cast<float>(static_cast<int32_t>(state)) * 1e-9f;
    state = state * 1664525u + 1013904223u;
    const float u = static_cast<float>(static_cast<int32_t>(state)) * 1e-9f;
    const float f = 0.0123456789f;
    const bool keep = u * p >= 0.f;
    const float expected = keep ? p - p * f : p;  // built with -ffp-contract=off: two roundings
    EXPECT_EQ(float_bits(cautious_decay_element<float>(p, u, f)), float_bits(expected)) << p << " " << u;
    const float pb = round_to<Bf16>(p);
    const float fb = round_to<Bf16>(f);
    const float expected_bf16 = u * pb >= 0.f ? round_to<Bf16>(pb - round_to<Bf16>(pb * fb)) : pb;
    EXPECT_EQ(float_bits(cautious_decay_element<Bf16>(pb, u, f)), float_bits(expected_bf16)) << pb << " " << u;
  }
}

// fp16 storage: the host conversion must match IEEE round-to-nearest-even (c10::Half, and
// __float2half_rn on the device) for every input.
namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Nearest fp16 of a non-negative finite float by search over every finite fp16 value; ties to the
// even bit pattern; 65520 and above round to infinity.
uint16_t nearest_half(float f) {
  if (f >= 65520.f) return 0x7C00;
  uint16_t lo = 0, hi = 0x7BFF;
  while (lo < hi) {  // last value <= f
    const uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (to_float(Fp16{mid}) <= f) lo = mid;
    else hi = static_cast<uint16_t>(mid - 1);
  }
  if (lo == 0x7BFF) return lo;
  const double below = to_float(Fp16{lo});
  const double above = to_float(Fp16{static_cast<uint16_t>(lo + 1)});
  const double d_below = static_cast<double>(f) - below;
  const double d_above = above - static_cast<double>(f);
  if (d_below < d_above) return lo;
  if (d_above < d_below) return static_cast<uint16_t>(lo + 1);
  return (lo & 1u) ? static_cast<uint16_t>(lo + 1) : lo;
}

}  // namespace

TEST(Fp16, WideningIsExactForEveryValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const Fp16 v{static_cast<uint16_t>(h)};
    const float f = to_float(v);
    const uint32_t exponent = (h >> 10) & 0x1F;
    if (exponent == 0x1F && (h & 0x3FF)) {
      EXPECT_TRUE(std::isnan(f));
      continue;
    }
    EXPECT_EQ(from_float<Fp16>(f).bits, h) << "half 0x" << std::hex << h;  // round trip
  }
  EXPECT_EQ(to_float(Fp16{0x3C00}), 1.f);
  EXPECT_EQ(to_float(Fp16{0x0001}), 5.9604644775390625e-08f);  // smallest subnormal, 2^-24
  EXPECT_EQ(to_float(Fp16{0xFBFF}), -65504.f);
}

TEST(Fp16, NarrowingRoundsToNearestEven) {
  uint32_t state = 12345;
  for (int k = 0; k < 200000; ++k) {
    state = state * 1664525u + 1013904223u;
    // magnitudes from 2^-30 (below the subnormals) to 2^17 (past the largest half)
    const uint32_t u = 0x30800000u + state % (0x48000000u - 0x30800000u);
    const float f = float_of(u);
    EXPECT_EQ(from_float<Fp16>(f).bits, nearest_half(f)) << "float 0x" << std::hex << u;
    EXPECT_EQ(from_float<Fp16>(-f).bits, static_cast<uint16_t>(nearest_half(f) | 0x8000u));
  }
  // Ties: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10 (even: 1); 1 + 3 * 2^-11 goes up.
  EXPECT_EQ(from_float<Fp16>(1.00048828125f).bits, 0x3C00);
  EXPECT_EQ(from_float<Fp16>(1.00146484375f).bits, 0x3C02);
  EXPECT_EQ(from_float<Fp16>(65519.f).bits, 0x7BFF);
  EXPECT_EQ(from_float<Fp16>(65520.f).bits, 0x7C00);
  EXPECT_EQ(from_float<Fp16>(std::numeric_limits<float>::infinity()).bits, 0x7C00);
  EXPECT_EQ(from_float<Fp16>(std::numeric_limits<float>::quiet_NaN()).bits, 0x7E00);
  EXPECT_EQ(from_float<Fp16>(-0.f).bits, 0x8000);
  EXPECT_EQ(from_float<Fp16>(float_of(0x33000000u)).bits, 0x0000);  // 2^-25: tie with 0, even
  EXPECT_EQ(from_float<Fp16>(float_of(0x33000001u)).bits, 0x0001);
  EXPECT_EQ(bits_of(round_to<Fp16>(0.1f)), bits_of(to_float(Fp16{0x2E66})));
}

TEST(MomentumMath, CoefficientsRoundTheReferencesPythonFloats) {
  // The lerp weight is float(1 - momentum) of the fp64 value, as the reference passes 1 - 0.95.
  const MomentumCoefficients c = momentum_coefficients(0.95, true, 1.0);
  EXPECT_EQ(c.ema_weight, static_cast<float>(1.0 - 0.95));
  EXPECT_NE(c.ema_weight, 1.f - 0.95f);  // what an fp32 momentum would give instead
  EXPECT_EQ(c.nesterov_weight, 0.95f);
  EXPECT_TRUE(c.nesterov);
}

TEST(MomentumMath, GradScaleUnscalesBeforeEverything) {
  const MomentumCoefficients scaled = momentum_coefficients(0.5, false, 1024.0);
  const MomentumCoefficients plain = momentum_coefficients(0.5, false, 1.0);
  // g = 2048 / 1024 = 2; l2: g = 2 + 0.5 * 4 = 4; M = 1 + 0.5 (4 - 1) = 2.5.
  EXPECT_EQ((momentum_element<float, float, true>(2048.f, 4.f, 0.5f, 1.f, scaled).buffer),
            (momentum_element<float, float, true>(2.f, 4.f, 0.5f, 1.f, plain).buffer));
  EXPECT_FLOAT_EQ((momentum_element<float, float, true>(2048.f, 4.f, 0.5f, 1.f, scaled).buffer), 2.5f);
  // fp16 gradients and buffers round the buffer to fp16.
  const MomentumResult h = momentum_element<Fp16, Fp16, false>(0.3f, 0.f, 0.f, -0.7f, plain);
  EXPECT_EQ(h.buffer, round_to<Fp16>(torch_lerp(-0.7f, 0.3f, 0.5f)));
}
