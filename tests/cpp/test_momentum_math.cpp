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
  const MomentumCoefficients plain{0.1f, 0.9f, false};
  const MomentumResult r = momentum_element<float, float, false>(2.f, 0.f, 0.f, 1.f, plain);
  EXPECT_FLOAT_EQ(r.buffer, 1.1f);
  EXPECT_EQ(r.ns_input, r.buffer);
  const MomentumCoefficients nesterov{0.1f, 0.9f, true};
  const MomentumResult n = momentum_element<float, float, false>(2.f, 0.f, 0.f, 1.f, nesterov);
  EXPECT_FLOAT_EQ(n.ns_input, 2.f + 0.9f * (1.1f - 2.f));
}

TEST(MomentumMath, L2DecayGoesIntoTheGradient) {
  const MomentumCoefficients c{0.5f, 0.5f, false};
  // g = 1 + 0.5 * 4 = 3; M = 1 + 0.5 (3 - 1) = 2.
  EXPECT_FLOAT_EQ((momentum_element<float, float, true>(1.f, 4.f, 0.5f, 1.f, c).buffer), 2.f);
  // Without l2 the parameter is ignored.
  EXPECT_FLOAT_EQ((momentum_element<float, float, false>(1.f, 4.f, 0.5f, 1.f, c).buffer), 1.f);
}

TEST(MomentumMath, Bf16StorageRoundsTheBufferAndTheNesterovInput) {
  const MomentumCoefficients c{0.05f, 0.95f, true};
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
