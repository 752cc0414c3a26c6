// The panel plan of symmetric products (symmetric_panels.h): the block columns, run through a
// reference column-major GEMM at their pointer offsets and completed by the mirror rule, give
// the full product on every matrix of a batch, and write nothing outside it.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/symmetric_panels.h"
#include "reference_gemm.h"

using megatron_eopt::GemmPanel;
using megatron_eopt::GemmShape;
using megatron_eopt::make_ns_gemm_plan;
using megatron_eopt::measured_symmetric_blocks;
using megatron_eopt::mirror_source_is_lower;
using megatron_eopt::padded_square_ld;
using megatron_eopt::symmetric_panel_fraction;
using megatron_eopt::symmetric_panel_width;
using megatron_eopt::symmetric_panels;
using megatron_eopt::SymmetricPanelRule;

namespace {

using megatron_eopt::testing::reference_gemm;

// Runs `full` as panels of `width` plus the mirror into a buffer first filled with NaN.
std::vector<double> run_panels(const GemmShape& full, int64_t batch, int64_t width, double alpha,
                               const std::vector<double>& a, const std::vector<double>& b, double beta,
                               const std::vector<double>& c) {
  std::vector<double> d(c.size(), std::numeric_limits<double>::quiet_NaN());
  for (const GemmPanel& p : symmetric_panels(full, width)) {
    reference_gemm(p.shape, batch, alpha, a.data() + p.a_offset, b.data() + p.b_offset, beta, c.data() + p.cd_offset,
                   d.data() + p.cd_offset);
  }
  const int64_t side = full.rows;
  for (int64_t t = 0; t < batch; ++t) {
    double* m = d.data() + t * full.stride_c;
    for (int64_t col = 0; col < side; ++col) {
      for (int64_t row = 0; row < side; ++row) {
        if (mirror_source_is_lower(row, col, width)) m[row + col * full.ldc] = m[col + row * full.ldc];
      }
    }
  }
  return d;
}

std::vector<double> random_values(std::size_t count, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist;
  std::vector<double> v(count);
  for (double& x : v) x = dist(gen);
  return v;
}

// Symmetrizes each padded side x side matrix in place (the C of B = c G G + b G is symmetric).
void symmetrize(std::vector<double>& g, int64_t batch, int64_t side, int64_t ld, int64_t stride) {
  for (int64_t t = 0; t < batch; ++t) {
    for (int64_t col = 0; col < side; ++col) {
      for (int64_t row = col + 1; row < side; ++row) g[t * stride + row + col * ld] = g[t * stride + col + row * ld];
    }
  }
}

void expect_same_square(const std::vector<double>& got, const std::vector<double>& want, int64_t batch, int64_t side,
                        int64_t ld, int64_t stride) {
  for (int64_t t = 0; t < batch; ++t) {
    for (int64_t col = 0; col < side; ++col) {
      for (int64_t row = 0; row < ld; ++row) {
        const std::size_t o = static_cast<std::size_t>(t * stride + row + col * ld);
        if (row < side) {
          ASSERT_NEAR(got[o], want[o], 1e-9 * (1 + std::abs(want[o])))
              << "matrix " << t << " (" << row << ", " << col << ")";
        } else {
          ASSERT_TRUE(std::isnan(got[o])) << "padding row " << row << " of column " << col << " was written";
        }
      }
    }
  }
}

struct Case {
  int64_t batch, m, n;
  bool transpose;
  int64_t width;
};

class SymmetricPanelsTest : public ::testing::TestWithParam<Case> {};

TEST_P(SymmetricPanelsTest, GramAndPolynomialProductsEqualTheFullOnes) {
  const Case cs = GetParam();
  const int64_t side = cs.transpose ? cs.n : cs.m;
  const auto plan = make_ns_gemm_plan(cs.m, cs.n, cs.transpose, padded_square_ld(side));
  const std::size_t square = static_cast<std::size_t>(cs.batch * plan.square_stride);
  const std::vector<double> x = random_values(static_cast<std::size_t>(cs.batch * cs.m * cs.n), 7);
  const std::vector<double> nan(square, std::numeric_limits<double>::quiet_NaN());

  // G = W W^T: no C read.
  std::vector<double> g_full = nan;
  reference_gemm(plan.gram_gemm, cs.batch, 1.0, x.data(), x.data(), 0.0, g_full.data(), g_full.data());
  const std::vector<double> g_panels = run_panels(plan.gram_gemm, cs.batch, cs.width, 1.0, x, x, 0.0, nan);
  expect_same_square(g_panels, g_full, cs.batch, side, plan.square_ld, plan.square_stride);

  // B = c G G + b G with a symmetric G (its padding filled, as a BLAS would never read it).
  std::vector<double> g = random_values(square, 11);
  symmetrize(g, cs.batch, side, plan.square_ld, plan.square_stride);
  std::vector<double> b_full = nan;
  reference_gemm(plan.poly_gemm, cs.batch, -0.7, g.data(), g.data(), 1.3, g.data(), b_full.data());
  const std::vector<double> b_panels = run_panels(plan.poly_gemm, cs.batch, cs.width, -0.7, g, g, 1.3, g);
  expect_same_square(b_panels, b_full, cs.batch, side, plan.square_ld, plan.square_stride);
}

INSTANTIATE_TEST_SUITE_P(Shapes, SymmetricPanelsTest,
                         ::testing::Values(Case{1, 128, 200, false, 64},   // wide, 2 blocks
                                           Case{3, 200, 130, true, 64},    // tall, ragged last block, batch
                                           Case{2, 193, 193, false, 64},   // square prime-ish side, 4 blocks
                                           Case{2, 97, 300, false, 97},    // one block: the full product
                                           Case{1, 1, 77, false, 64},      // 1 x n: side 1
                                           Case{2, 260, 3, true, 128}));   // n x small, wide side 3

TEST(SymmetricPanelWidth, FollowsTheRuleAndTheQuantum) {
  EXPECT_EQ(symmetric_panel_width(4096, 4), 1024);
  EXPECT_EQ(symmetric_panel_width(1000, 4), 256);  // ceil(250) rounded up to 64
  EXPECT_EQ(symmetric_panel_width(100, 4), 64);
  EXPECT_EQ(symmetric_panel_width(64, 4), 64);     // no larger than the side: one block
  EXPECT_EQ(symmetric_panel_width(4096, 1), 4096);
  EXPECT_EQ(symmetric_panel_width(4096, SymmetricPanelRule{1, 1024}), 4096);  // off
  EXPECT_EQ(symmetric_panel_width(4096, SymmetricPanelRule{4, 1024}), 1024);
  EXPECT_EQ(symmetric_panel_width(1500, SymmetricPanelRule{4, 1024}), 1500);  // one block of 1024 fits
  EXPECT_EQ(symmetric_panel_width(2048, SymmetricPanelRule{4, 1024}), 1024);
  EXPECT_EQ(symmetric_panel_width(8192, SymmetricPanelRule{8, 512}), 1024);
  EXPECT_EQ(symmetric_panel_width(11008, SymmetricPanelRule{4, 1024}), 2752);
}

TEST(MeasuredSymmetricBlocks, OnlyWhereTheH100RanThemFaster) {
  EXPECT_EQ(measured_symmetric_blocks(8192, 1, true), 4);
  EXPECT_EQ(measured_symmetric_blocks(14336, 1, true), 4);
  EXPECT_EQ(measured_symmetric_blocks(4096, 4, true), 4);
  EXPECT_EQ(measured_symmetric_blocks(4096, 1, true), 1);   // 0.88x measured
  EXPECT_EQ(measured_symmetric_blocks(2048, 16, true), 1);  // 2048-wide: slower
  EXPECT_EQ(measured_symmetric_blocks(8192, 1, false), 1);  // TF32 / fp32 not measured
  EXPECT_EQ(symmetric_panel_width(8192, measured_symmetric_blocks(8192, 1, true)), 2048);
}

TEST(SymmetricPanelFraction, CountsTheLowerBlockTriangle) {
  EXPECT_DOUBLE_EQ(symmetric_panel_fraction(4096, 4096), 1.0);
  EXPECT_DOUBLE_EQ(symmetric_panel_fraction(4096, 1024), 0.625);
  EXPECT_DOUBLE_EQ(symmetric_panel_fraction(4096, 512), 0.5625);
  EXPECT_EQ(symmetric_panels(make_ns_gemm_plan(4096, 4096, false).gram_gemm, 1024).size(), 4u);
}

}  // namespace
