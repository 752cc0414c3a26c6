#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "megatron_eopt/ns_recipe.h"

using megatron_eopt::make_ns_recipe;
using megatron_eopt::muon_plus_factor;
using megatron_eopt::muoneq_row_factor;
using megatron_eopt::ns_denominator;
using megatron_eopt::ns_row_scales;
using megatron_eopt::NsEpsMode;
using megatron_eopt::NsRecipe;

TEST(NsRecipe, DefaultDenominatorIsTheClampExactly) {
  // The defaults must leave the op's max(||x||, eps) bit for bit.
  for (float norm : {0.f, 1e-9f, 1e-7f, 0.3f, 1.f, 12345.678f, 3.4e38f}) {
    const float want = std::fmax(norm, 1e-7f);
    EXPECT_EQ(ns_denominator(norm, 1e-7f, 1.f, NsEpsMode::kClamp), want) << norm;
  }
  EXPECT_TRUE(std::isnan(ns_denominator(std::nanf(""), 1e-7f, 1.f, NsEpsMode::kClamp)));
}

TEST(NsRecipe, ConventionsAndDivisor) {
  EXPECT_FLOAT_EQ(ns_denominator(2.f, 1e-3f, 1.f, NsEpsMode::kAdd), 2.001f);
  EXPECT_FLOAT_EQ(ns_denominator(2.f, 1e-3f, 1.02f, NsEpsMode::kAdd), 2.04f + 1e-3f);
  EXPECT_FLOAT_EQ(ns_denominator(2.f, 1e-3f, 1.02f, NsEpsMode::kClamp), 2.04f);
  // Below eps: the clamp takes eps (then the divisor), add keeps the norm.
  EXPECT_FLOAT_EQ(ns_denominator(1e-9f, 1e-7f, 1.01f, NsEpsMode::kClamp), 1.01e-7f);
  EXPECT_FLOAT_EQ(ns_denominator(1e-9f, 1e-7f, 1.f, NsEpsMode::kAdd), 1.01e-7f);
  EXPECT_FLOAT_EQ(ns_denominator(0.f, 1e-7f, 1.f, NsEpsMode::kAdd), 1e-7f);
}

TEST(NsRecipe, ParsesAndRejects) {
  EXPECT_EQ(make_ns_recipe("add", 1.0, false, false).eps_mode, NsEpsMode::kAdd);
  EXPECT_TRUE(make_ns_recipe("clamp", 1.0, false, false).is_default());
  EXPECT_FALSE(make_ns_recipe("clamp", 1.0, false, true).is_default());
  EXPECT_FALSE(make_ns_recipe("clamp", 1.0, false, true).changes_input());
  EXPECT_TRUE(make_ns_recipe("clamp", 1.01, false, false).changes_input());
  EXPECT_TRUE(make_ns_recipe("clamp", 1.0, true, false).changes_input());
  EXPECT_TRUE(make_ns_recipe("add", 1.0, false, false).changes_input());
  try {
    make_ns_recipe("sum", 1.0, false, false);
    FAIL() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("eps_mode"), std::string::npos);
  }
  for (double bad : {0.5, -1.0, std::numeric_limits<double>::infinity(), std::nan(""), 1e300}) {
    try {
      make_ns_recipe("clamp", bad, false, false);
      FAIL() << "no error for " << bad;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("norm_divisor"), std::string::npos);
    }
  }
}

TEST(NsRecipe, MuonEqAndMuonPlusFactors) {
  // 4 rows, ||x||_F = 4: the RMS row norm is 2.
  EXPECT_FLOAT_EQ(muoneq_row_factor(1.f, 4.f, 4), 2.f);
  EXPECT_FLOAT_EQ(muoneq_row_factor(4.f, 4.f, 4), 0.5f);
  EXPECT_FLOAT_EQ(muoneq_row_factor(0.f, 4.f, 4), 2e6f);  // floored at 1e-6
  EXPECT_FLOAT_EQ(muon_plus_factor(2.f, 9, 4), 1.f);      // sqrt(min(9, 4)) / 2
  EXPECT_FLOAT_EQ(muon_plus_factor(0.f, 1, 7), 1e6f);     // floored at 1e-6
}

// Row scales of one matrix from its rows' sums of squares, against the formulas in double.
TEST(NsRecipe, RowScalesMatchTheFormulas) {
  const std::vector<double> row_norms{0.5, 3.0, 0.0, 1e-8, 2.25};
  const int64_t m = static_cast<int64_t>(row_norms.size());
  double frob2 = 0;
  for (double r : row_norms) frob2 += r * r;
  const double frob = std::sqrt(frob2);
  for (NsEpsMode mode : {NsEpsMode::kClamp, NsEpsMode::kAdd}) {
    for (float divisor : {1.f, 1.02f}) {
      NsRecipe recipe;
      recipe.eps_mode = mode;
      recipe.norm_divisor = divisor;
      const double eps = 1e-7;
      // without MuonEq: every row 1 / denominator(||x||)
      std::vector<double> scales(m);
      for (int64_t i = 0; i < m; ++i) scales[i] = row_norms[i] * row_norms[i];
      ns_row_scales(scales.data(), m, static_cast<float>(eps), recipe);
      const double denom = mode == NsEpsMode::kAdd ? frob * divisor + eps : std::max(frob, eps) * divisor;
      for (int64_t i = 0; i < m; ++i) EXPECT_NEAR(scales[i] * denom, 1.0, 1e-6);
      // with MuonEq
      recipe.row_equilibration = true;
      for (int64_t i = 0; i < m; ++i) scales[i] = row_norms[i] * row_norms[i];
      ns_row_scales(scales.data(), m, static_cast<float>(eps), recipe);
      std::vector<double> f(m);
      double eq2 = 0;
      for (int64_t i = 0; i < m; ++i) {
        f[i] = frob / std::sqrt(static_cast<double>(m)) / std::max(row_norms[i], 1e-6);
        eq2 += f[i] * row_norms[i] * f[i] * row_norms[i];
      }
      const double eq = std::sqrt(eq2);
      const double eq_denom = mode == NsEpsMode::kAdd ? eq * divisor + eps : std::max(eq, eps) * divisor;
      for (int64_t i = 0; i < m; ++i) EXPECT_NEAR(scales[i] / (f[i] / eq_denom), 1.0, 1e-6) << i;
      // The equilibrated rows: non-negligible ones share the RMS norm, and the matrix ends with
      // norm 1 / s up to eps.
      double out2 = 0;
      for (int64_t i = 0; i < m; ++i) out2 += scales[i] * row_norms[i] * scales[i] * row_norms[i];
      EXPECT_NEAR(std::sqrt(out2) * divisor, 1.0, 1e-5);
    }
  }
}

TEST(NsRecipe, RowScalesOfAZeroMatrixStayFinite) {
  NsRecipe recipe;
  recipe.row_equilibration = true;
  std::vector<float> scales(3, 0.f);
  ns_row_scales(scales.data(), 3, 1e-7f, recipe);
  for (float s : scales) EXPECT_EQ(s, 0.f);  // factor 0 / 1e-6 = 0, denominator eps
}
