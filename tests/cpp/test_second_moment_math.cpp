#include <gtest/gtest.h>

#include <cmath>

#include "megatron_eopt/second_moment_math.h"

using namespace megatron_eopt;

TEST(SecondMomentMath, EmaLerpMatchesTheClosedForm) {
  EXPECT_FLOAT_EQ(torch_lerp(2.f, 4.f, 0.05f), 0.95f * 2.f + 0.05f * 4.f);
  EXPECT_FLOAT_EQ(torch_lerp(2.f, 4.f, 0.75f), 0.25f * 2.f + 0.75f * 4.f);
  EXPECT_EQ(torch_lerp(2.f, 4.f, 1.f), 4.f);  // beta2 = 0: the new value exactly
  EXPECT_EQ(torch_lerp(2.f, 4.f, 0.f), 2.f);  // beta2 = 1: state frozen
}

// The state updates are torch's lerp to the bit: one fma on each side of |weight| = 0.5.
TEST(SecondMomentMath, EmaIsTorchsFusedLerp) {
  // o^2 = 2.25 is exact; for v = 0.002 the fused lerp and an unfused one differ in the last bit.
  float v = 0.002f;
  adamuon_normalize(1.5f, v, 0.05f, 1e-8f);
  EXPECT_EQ(v, std::fmaf(0.05f, 2.25f - 0.002f, 0.002f));
  float s = 0.3f;
  namo_scale(s, 5.f, 1.f, 0.9f, 1e-8f);
  EXPECT_EQ(s, std::fmaf(0.9f - 1.f, 5.f - 0.3f, 5.f));
}

TEST(SecondMomentMath, Adamuon) {
  float v = 0.5f;
  const float out = adamuon_normalize(2.f, v, 0.1f, 1e-8f);
  EXPECT_FLOAT_EQ(v, 0.9f * 0.5f + 0.1f * 4.f);
  EXPECT_FLOAT_EQ(out, 2.f / (std::sqrt(v) + 1e-8f));
  float zero_state = 0.f;
  EXPECT_EQ(adamuon_normalize(0.f, zero_state, 0.05f, 1e-8f), 0.f);
  EXPECT_EQ(zero_state, 0.f);
}

TEST(SecondMomentMath, NormuonSliceAndRatio) {
  float v = 1.f;
  // slice of 4 elements whose squares sum to 8: mean 2
  const float step = normuon_slice_step(v, 8.f, 4, 0.5f, 1e-8f);
  EXPECT_FLOAT_EQ(v, 1.5f);
  EXPECT_FLOAT_EQ(step, 1.f / std::sqrt(1.5f));
  EXPECT_FLOAT_EQ(normuon_step_size(v, 1e-8f), step);
  EXPECT_FLOAT_EQ(normuon_step_size(0.f, 1e-4f), 100.f);  // clamped at eps
  EXPECT_FLOAT_EQ(normuon_norm_ratio(9.f, 4.f, 1e-8f), 1.5f);
  EXPECT_EQ(normuon_norm_ratio(0.f, 0.f, 1e-8f), 0.f);  // zero O stays zero, no NaN
}

TEST(SecondMomentMath, Namo) {
  float v = 4.f;
  const float factor = namo_scale(v, 16.f, 9.f, 0.25f, 1e-8f);
  EXPECT_FLOAT_EQ(v, 0.75f * 4.f + 0.25f * 16.f);
  EXPECT_FLOAT_EQ(factor, 3.f / (std::sqrt(7.f) + 1e-8f));
  float zero_state = 0.f;
  EXPECT_EQ(namo_scale(zero_state, 0.f, 0.f, 0.05f, 1e-8f), 0.f);
}
