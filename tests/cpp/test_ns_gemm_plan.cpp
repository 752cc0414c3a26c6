// Checks the column-major GEMM plan by running it through a naive reference GEMM on small
// row-major matrices and comparing with a direct row-major evaluation of the NS step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "megatron_eopt/ns_precision.h"
#include "megatron_eopt/ns_gemm_plan.h"
#include "reference_gemm.h"

using megatron_eopt::GemmShape;
using megatron_eopt::make_ns_gemm_plan;

namespace {

// Column-major D = alpha op(A) op(B) + beta C over a batch, as a BLAS would compute it.
void ref_gemm(const GemmShape& s, int64_t batch, double alpha, const std::vector<double>& a,
              const std::vector<double>& b, double beta, const std::vector<double>& c, std::vector<double>& d) {
  megatron_eopt::testing::reference_gemm(s, batch, alpha, a.data(), b.data(), beta, c.data(), d.data());
}

void check_plan(int64_t batch, int64_t m, int64_t n, bool transpose, int64_t square_ld = 0) {
  std::mt19937 rng(static_cast<unsigned>(m * 131 + n * 7 + transpose));
  std::normal_distribution<double> normal;
  std::vector<double> x(batch * m * n);
  for (double& v : x) v = normal(rng) * 0.1;
  const double a = 3.4445, b = -4.7750, c = 2.0315;

  const auto plan = make_ns_gemm_plan(m, n, transpose, square_ld);
  const int64_t g = plan.gram;
  EXPECT_EQ(g, transpose ? n : m);
  EXPECT_EQ(plan.square_ld, std::max(square_ld, g));
  EXPECT_EQ(plan.square_stride, plan.square_ld * g);
  // Padding entries hold NaN: a plan that read them would poison the result.
  std::vector<double> gram(batch * plan.square_stride, std::nan("")), poly(batch * plan.square_stride, std::nan(""));
  std::vector<double> xout(x.size());
  ref_gemm(plan.gram_gemm, batch, 1.0, x, x, 0.0, gram, gram);
  ref_gemm(plan.poly_gemm, batch, c, gram, gram, b, gram, poly);
  if (plan.work_transposed) ref_gemm(plan.update_gemm, batch, 1.0, poly, x, a, x, xout);
  else ref_gemm(plan.update_gemm, batch, 1.0, x, poly, a, x, xout);

  const auto expected = megatron_eopt::testing::reference_ns_step(x, batch, m, n, transpose, a, b, c);
  for (std::size_t i = 0; i < x.size(); ++i) {
    ASSERT_NEAR(xout[i], expected[i], 1e-12) << "m=" << m << " n=" << n << " transpose=" << transpose << " i=" << i;
  }
}

}  // namespace

TEST(NsGemmPlan, WideMatrices) {
  check_plan(1, 3, 7, false);
  check_plan(2, 1, 5, false);
  check_plan(3, 4, 4, false);
}

TEST(NsGemmPlan, TallMatrices) {
  check_plan(1, 7, 3, true);
  check_plan(2, 5, 1, true);
  check_plan(2, 13, 5, true);
}

TEST(NsGemmPlan, ForcedTransposeOfWideAndNoTransposeOfTall) {
  check_plan(2, 3, 7, true);
  check_plan(2, 7, 3, false);
}

TEST(NsGemmPlan, PaddedSquareLeadingDimension) {
  for (const bool transpose : {false, true}) {
    check_plan(3, 5, 11, transpose, megatron_eopt::padded_square_ld(transpose ? 11 : 5));
    check_plan(2, 9, 4, transpose, megatron_eopt::padded_square_ld(transpose ? 4 : 9));
    check_plan(2, 1, 6, transpose, 13);
  }
  EXPECT_EQ(megatron_eopt::padded_square_ld(1), 8);
  EXPECT_EQ(megatron_eopt::padded_square_ld(8), 8);
  EXPECT_EQ(megatron_eopt::padded_square_ld(97), 104);
}

TEST(NsGemmPlan, GramSideIsTheWorkingRows) {
  EXPECT_EQ(make_ns_gemm_plan(4096, 11008, false).gram, 4096);
  EXPECT_EQ(make_ns_gemm_plan(11008, 4096, true).gram, 4096);
}

TEST(NsPrecision, CpuMediumIteratesTinyGramSidesInFp32) {
  using namespace megatron_eopt;
  EXPECT_EQ(cpu_iteration_precision(NsPrecision::kMedium, 1), NsPrecision::kHighest);
  EXPECT_EQ(cpu_iteration_precision(NsPrecision::kMedium, kCpuMediumMinSide - 1), NsPrecision::kHighest);
  EXPECT_EQ(cpu_iteration_precision(NsPrecision::kMedium, kCpuMediumMinSide), NsPrecision::kMedium);
  EXPECT_EQ(cpu_iteration_precision(NsPrecision::kMedium, 2), NsPrecision::kHighest);
  EXPECT_EQ(cpu_iteration_precision(NsPrecision::kMedium, 4096), NsPrecision::kMedium);
  EXPECT_EQ(cpu_iteration_precision(NsPrecision::kHigh, 1), NsPrecision::kHigh);
  EXPECT_EQ(cpu_iteration_precision(NsPrecision::kHighest, 1), NsPrecision::kHighest);
}
