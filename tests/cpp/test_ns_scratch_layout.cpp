// The standard Newton–Schulz iteration's CUDA scratch layout: buffers 256-byte aligned and apart,
// and G and B in the input's storage only where a call writes over its input under "medium" and
// they fit there.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_scratch_layout.h"

namespace megatron_eopt {
namespace {

struct Case {
  int64_t batch, m, n;
};

const Case kCases[] = {{1, 1, 9},   {1, 9, 1},      {1, 8, 8},       {3, 97, 37},      {2, 37, 97},
                       {1, 16, 16}, {8, 768, 2048}, {1, 4096, 4096}, {1, 4096, 11008}, {5, 7, 7}};

std::vector<std::pair<std::size_t, std::size_t>> spans(const NsScratchLayout& l, std::size_t iterate,
                                                       std::size_t product) {
  std::vector<std::pair<std::size_t, std::size_t>> s;
  if (l.iterate0 != SIZE_MAX) s.emplace_back(l.iterate0, l.iterate0 + iterate);
  s.emplace_back(l.iterate1, l.iterate1 + iterate);
  if (!l.products_in_input) {
    s.emplace_back(l.gram, l.gram + product);
    s.emplace_back(l.poly, l.poly + product);
  }
  s.emplace_back(l.sum_squares, l.norm_partials);
  s.emplace_back(l.norm_partials, l.total);
  return s;
}

TEST(NsScratchLayout, BuffersAreAlignedAndApartInEveryPrecision) {
  for (const Case& c : kCases) {
    for (bool transpose : {false, true}) {
      for (NsPrecision p : {NsPrecision::kMedium, NsPrecision::kHigh, NsPrecision::kHighest}) {
        for (bool over_input : {false, true}) {
          const NsScratchLayout l = ns_scratch_layout(c.batch, c.m, c.n, transpose, p, 40, over_input);
          const std::size_t iterate = static_cast<std::size_t>(c.batch * c.m * c.n) * ns_element_bytes(p);
          const std::size_t product = ns_product_bytes(c.batch, c.m, c.n, transpose, p);
          const int64_t g = transpose ? c.n : c.m;
          EXPECT_GE(product, static_cast<std::size_t>(c.batch * g * g) * ns_element_bytes(p));
          EXPECT_EQ(l.iterate0 == SIZE_MAX, p != NsPrecision::kMedium);  // fp32: out is iterate[0]
          auto s = spans(l, iterate, product);
          std::sort(s.begin(), s.end());
          for (std::size_t i = 0; i < s.size(); ++i) {
            EXPECT_EQ(s[i].first % 256, 0u);
            if (i + 1 < s.size()) EXPECT_LE(s[i].second, s[i + 1].first);
          }
          EXPECT_LE(s.back().second, l.total);
          EXPECT_GE(l.total - l.norm_partials, 40 * sizeof(float));
        }
      }
    }
  }
}

TEST(NsScratchLayout, ProductsTakeTheInputOnlyWritingOverItUnderMediumWhereTheyFit) {
  for (const Case& c : kCases) {
    for (bool transpose : {false, true}) {
      for (NsPrecision p : {NsPrecision::kMedium, NsPrecision::kHigh, NsPrecision::kHighest}) {
        const NsScratchLayout apart = ns_scratch_layout(c.batch, c.m, c.n, transpose, p, 1, false);
        const NsScratchLayout over = ns_scratch_layout(c.batch, c.m, c.n, transpose, p, 1, true);
        EXPECT_FALSE(apart.products_in_input);
        const std::size_t product = ns_product_bytes(c.batch, c.m, c.n, transpose, p);
        const std::size_t input = static_cast<std::size_t>(c.batch * c.m * c.n) * sizeof(float);
        const bool fits = p == NsPrecision::kMedium && 2 * product <= input;
        EXPECT_EQ(over.products_in_input, fits);
        if (fits) {
          EXPECT_EQ(over.gram, 0u);
          EXPECT_EQ(over.poly, product);  // 256-byte aligned, and both end inside the input
          EXPECT_LE(over.poly + product, input);
          EXPECT_EQ(over.total, apart.total - 2 * product);
          // What the GEMMs address, from the GEMM plan itself: the last matrix's last padded column.
          const int64_t g = transpose ? c.n : c.m;
          const NsGemmPlan plan = make_ns_gemm_plan(c.m, c.n, transpose, padded_square_ld(g));
          const int64_t last = (c.batch - 1) * plan.square_stride + (g - 1) * plan.square_ld + g;
          EXPECT_LE(static_cast<std::size_t>(last) * 2, product);
        } else {
          EXPECT_EQ(over.total, apart.total);
        }
      }
    }
  }
  // Rectangular expert matrices under "medium": 768 x 768 G and B (2.25 MiB) come off the scratch.
  EXPECT_TRUE(ns_products_fit_in_input(8, 768, 2048, false, NsPrecision::kMedium));
  EXPECT_TRUE(ns_products_fit_in_input(1, 4096, 4096, false, NsPrecision::kMedium));
  // By hand: 3 x (17 x 40): G is 17 rows of 24 bf16 (3 x 816 = 2448 bytes, 2560 aligned), twice
  // that within 3 x 17 x 40 x 4 = 8160 bytes. 16 x 16: 512 + 512 bytes fill the 1024 exactly. 1 x 128:
  // a 1 x 8 G takes 256 bytes aligned, two of them the input's 512; 1 x 127 leaves 508.
  EXPECT_EQ(ns_product_bytes(3, 17, 40, false, NsPrecision::kMedium), 2560u);
  EXPECT_TRUE(ns_products_fit_in_input(3, 17, 40, false, NsPrecision::kMedium));
  EXPECT_TRUE(ns_products_fit_in_input(1, 16, 16, false, NsPrecision::kMedium));
  EXPECT_TRUE(ns_products_fit_in_input(1, 1, 128, false, NsPrecision::kMedium));
  EXPECT_FALSE(ns_products_fit_in_input(1, 1, 127, false, NsPrecision::kMedium));
  // A square 7 x 7 pads G's rows to 8 and aligns to 256 bytes: more than the input's 196 bytes.
  EXPECT_FALSE(ns_products_fit_in_input(1, 7, 7, false, NsPrecision::kMedium));
  EXPECT_FALSE(ns_products_fit_in_input(8, 768, 2048, false, NsPrecision::kHighest));
}

TEST(NsCpuBf16Layout, ProductsAfterTheIterateWhereTheyFitAligned) {
  for (const Case& c : kCases) {
    for (bool transpose : {false, true}) {
      const int64_t side = transpose ? c.n : c.m, iterate = c.batch * c.m * c.n, square = c.batch * side * side;
      const NsCpuBf16Layout l = ns_cpu_bf16_layout(c.batch, c.m, c.n, side);
      if (l.gram < 0) EXPECT_LT(l.poly, 0);  // P is placed only after G
      for (int64_t at : {l.gram, l.poly}) {
        if (at < 0) continue;
        EXPECT_EQ(at % 32, 0);                   // 64 bytes of bf16
        EXPECT_GE(at, iterate);                  // after the iterate
        EXPECT_LE(at + square, 2 * iterate);     // inside the fp32 output's bytes
      }
      if (l.gram >= 0 && l.poly >= 0) EXPECT_GE(l.poly, l.gram + square);
    }
  }
  // By hand (bf16 values): a 2048 x 8192 output holds 2 x 16 Mi; the iterate takes the first 16 Mi,
  // G and P (4 Mi each) follow. 128 x 128: G fills the second half exactly, P does not fit. 1 x 9:
  // the 64-byte boundary after the iterate is already past the output's 18 values.
  const NsCpuBf16Layout wide = ns_cpu_bf16_layout(1, 2048, 8192, 2048);
  EXPECT_EQ(wide.gram, int64_t{16} << 20);
  EXPECT_EQ(wide.poly, int64_t{20} << 20);
  const NsCpuBf16Layout square = ns_cpu_bf16_layout(1, 128, 128, 128);
  EXPECT_EQ(square.gram, 16384);
  EXPECT_EQ(square.poly, -1);
  EXPECT_EQ(ns_cpu_aligned_elems(16, 4), 16);  // whole 64-byte lines: 16 floats, 32 bf16 values
  EXPECT_EQ(ns_cpu_aligned_elems(17, 4), 32);
  EXPECT_EQ(ns_cpu_aligned_elems(33, 2), 64);
  EXPECT_EQ(ns_cpu_aligned_elems(0, 2), 0);
  const NsCpuBf16Layout tiny = ns_cpu_bf16_layout(1, 1, 9, 1);
  EXPECT_EQ(tiny.gram, -1);
  EXPECT_EQ(tiny.poly, -1);
}

}  // namespace
}  // namespace megatron_eopt
