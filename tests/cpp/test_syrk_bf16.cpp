// The CPU's symmetric bf16 product C = X X^T (syrk_bf16.h) against a float64 reference, on awkward
// shapes (1 x n, n x 1, odd depths, sides off the 8 x 32 tiles) and every operand layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/syrk_bf16.h"

namespace megatron_eopt {
namespace {

struct Layout {
  const char* name;
  // Element (i, k) of a side x depth matrix at i * row + k * col, matrices batch_stride apart.
  int64_t row, col, batch_stride;
};

Layout make_layout(int which, int64_t side, int64_t depth) {
  switch (which) {
    case 0: return {"rows contiguous", depth, 1, side * depth};
    case 1: return {"transposed view", 1, side, side * depth};
    case 2: return {"padded rows", depth + 3, 1, side * (depth + 3) + 5};
    case 3: return {"padded transposed", 1, side + 2, (side + 2) * depth + 1};
    default: return {"both strided", 2 * depth + 1, 2, side * (2 * depth + 1)};
  }
}

Bf16 random_bf16(std::mt19937& gen) {
  std::normal_distribution<float> normal(0.f, 1.f);
  return from_float<Bf16>(normal(gen));
}

void check_product(int64_t batch, int64_t side, int64_t depth, int which, std::mt19937& gen) {
  const Layout layout = make_layout(which, side, depth);
  const SyrkBf16Shape shape{batch, side, depth};
  std::vector<Bf16> x(static_cast<std::size_t>(batch * layout.batch_stride + side * layout.row + depth * layout.col + 8));
  for (Bf16& v : x) v = random_bf16(gen);
  std::vector<uint32_t> packed(static_cast<std::size_t>(shape.packed_words()), 0xDEADBEEFu);
  // NaN everywhere first, so that an element no tile writes is caught.
  std::vector<Bf16> c(static_cast<std::size_t>(batch * side * side), Bf16{0x7FC1});

  // Both passes split in two ranges, as two threads would run them.
  const int64_t panel_tasks = batch * shape.panels(), tiles = batch * shape.tiles_per_matrix();
  syrk_bf16_pack(x.data(), layout.batch_stride, layout.row, layout.col, shape, packed.data(), 0, panel_tasks / 2);
  syrk_bf16_pack(x.data(), layout.batch_stride, layout.row, layout.col, shape, packed.data(), panel_tasks / 2,
                 panel_tasks);
  syrk_bf16_tiles(packed.data(), shape, c.data(), 0, tiles / 3);
  syrk_bf16_tiles(packed.data(), shape, c.data(), tiles / 3, tiles);

  for (int64_t b = 0; b < batch; ++b) {
    const Bf16* xb = x.data() + b * layout.batch_stride;
    for (int64_t i = 0; i < side; ++i) {
      for (int64_t j = 0; j < side; ++j) {
        double exact = 0, magnitude = 0;
        for (int64_t k = 0; k < depth; ++k) {
          const double p = static_cast<double>(to_float(xb[i * layout.row + k * layout.col])) *
                           static_cast<double>(to_float(xb[j * layout.row + k * layout.col]));
          exact += p;
          magnitude += std::fabs(p);
        }
        const Bf16 got = c[static_cast<std::size_t>((b * side + i) * side + j)];
        const Bf16 mirror = c[static_cast<std::size_t>((b * side + j) * side + i)];
        ASSERT_EQ(got.bits, mirror.bits) << layout.name << " " << side << "x" << depth << " not symmetric at " << i
                                         << "," << j;
        // One bf16 rounding of the result plus fp32 accumulation over the depth.
        const double bound = std::ldexp(std::fabs(exact), -8) + static_cast<double>(depth) * std::ldexp(magnitude, -23);
        ASSERT_LE(std::fabs(static_cast<double>(to_float(got)) - exact), bound)
            << layout.name << " batch " << b << " " << side << "x" << depth << " at " << i << "," << j;
      }
    }
  }
}

TEST(SyrkBf16, TileCountCoversTheUpperTriangle) {
  // Column panel q (32 columns) takes the 8-row tiles of rows [0, min(side, 32 (q + 1))).
  EXPECT_EQ((SyrkBf16Shape{1, 1, 5}.tiles_per_matrix()), 1);
  EXPECT_EQ((SyrkBf16Shape{1, 32, 5}.tiles_per_matrix()), 4);
  EXPECT_EQ((SyrkBf16Shape{1, 33, 5}.tiles_per_matrix()), 4 + 5);
  EXPECT_EQ((SyrkBf16Shape{1, 64, 5}.tiles_per_matrix()), 4 + 8);
  EXPECT_EQ((SyrkBf16Shape{1, 768, 5}.tiles_per_matrix()), 4 * 24 * 25 / 2);
  EXPECT_EQ((SyrkBf16Shape{3, 7, 5}.packed_words()), 3 * 1 * 3 * 32);
}

TEST(SyrkBf16, MatchesFloat64OnAwkwardShapesAndLayouts) {
  if (!syrk_bf16_available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  std::mt19937 gen(20261125u);
  const int64_t shapes[][2] = {{1, 1},   {1, 7},  {7, 1},   {5, 3},  {8, 2},    {31, 97},
                               {32, 32}, {33, 65}, {40, 17}, {64, 2}, {100, 37}, {129, 300}};
  for (const auto& s : shapes) {
    for (int which = 0; which < 5; ++which) {
      check_product(1, s[0], s[1], which, gen);
      if (HasFatalFailure()) return;
    }
  }
  for (int which = 0; which < 5; ++which) {
    check_product(3, 45, 33, which, gen);
    if (HasFatalFailure()) return;
  }
}

TEST(SyrkBf16, LongDepthAccumulatesInFp32) {
  if (!syrk_bf16_available()) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  // 4096 equal products (1 + 2^-7)^2 sum to 4160.25, whose bf16 is 4160: a sum rounded to bf16 on
  // the way would stall at 512 (each addend is under half a bf16 step there); fp32 does not.
  const int64_t side = 3, depth = 4096;
  std::vector<Bf16> x(static_cast<std::size_t>(side * depth), from_float<Bf16>(1.0f + 1.0f / 128));
  const SyrkBf16Shape shape{1, side, depth};
  std::vector<uint32_t> packed(static_cast<std::size_t>(shape.packed_words()));
  std::vector<Bf16> c(static_cast<std::size_t>(side * side));
  syrk_bf16_pack(x.data(), 0, depth, 1, shape, packed.data(), 0, shape.panels());
  syrk_bf16_tiles(packed.data(), shape, c.data(), 0, shape.tiles_per_matrix());
  const float exact = static_cast<float>(depth) * (1.0f + 1.0f / 128) * (1.0f + 1.0f / 128);
  for (const Bf16& v : c) EXPECT_EQ(v.bits, from_float<Bf16>(exact).bits);
}

}  // namespace
}  // namespace megatron_eopt
