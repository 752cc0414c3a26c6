// The CPU's symmetric product C = X X^T (syrk_cpu.h), bf16 and fp32, against a float64 reference,
// on awkward shapes (1 x n, n x 1, odd depths, sides off the 8 x 32 tiles) and every operand layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/syrk_cpu.h"
#include "megatron_eopt/storage_types.h"

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

// X's elements as stored (bf16 bits or fp32) and their values.
struct Operand {
  std::vector<Bf16> bf16;
  std::vector<float> fp32;
  double value(SyrkType type, int64_t at) const {
    return type == SyrkType::kBf16 ? static_cast<double>(to_float(bf16[static_cast<std::size_t>(at)]))
                                   : static_cast<double>(fp32[static_cast<std::size_t>(at)]);
  }
  const void* data(SyrkType type) const {
    return type == SyrkType::kBf16 ? static_cast<const void*>(bf16.data()) : static_cast<const void*>(fp32.data());
  }
};

// C's elements as written: bf16 bits or fp32 bits, NaN to start with, so that an element no tile
// writes is caught.
struct Result {
  std::vector<Bf16> bf16;
  std::vector<float> fp32;
  Result(SyrkType type, std::size_t n) {
    if (type == SyrkType::kBf16) bf16.assign(n, Bf16{0x7FC1});
    else fp32.assign(n, std::nanf(""));
  }
  void* data(SyrkType type) {
    return type == SyrkType::kBf16 ? static_cast<void*>(bf16.data()) : static_cast<void*>(fp32.data());
  }
  uint32_t bits(SyrkType type, std::size_t at) const {
    if (type == SyrkType::kBf16) return bf16[at].bits;
    uint32_t word;
    std::memcpy(&word, &fp32[at], sizeof(word));
    return word;
  }
  double value(SyrkType type, std::size_t at) const {
    return type == SyrkType::kBf16 ? static_cast<double>(to_float(bf16[at])) : static_cast<double>(fp32[at]);
  }
};

void check_product(SyrkType type, int64_t batch, int64_t side, int64_t depth, int which, std::mt19937& gen) {
  const Layout layout = make_layout(which, side, depth);
  const SyrkShape shape{batch, side, depth, type};
  const std::size_t elements = static_cast<std::size_t>(batch * layout.batch_stride + side * layout.row +
                                                        depth * layout.col + 8);
  std::normal_distribution<float> normal(0.f, 1.f);
  Operand x;
  for (std::size_t i = 0; i < elements; ++i) {
    if (type == SyrkType::kBf16) x.bf16.push_back(from_float<Bf16>(normal(gen)));
    else x.fp32.push_back(normal(gen));
  }
  std::vector<uint32_t> packed(static_cast<std::size_t>(shape.packed_words()), 0xDEADBEEFu);
  Result c(type, static_cast<std::size_t>(batch * side * side));

  // Both passes split in two ranges, as two threads would run them.
  const int64_t panel_tasks = batch * shape.panels(), tiles = batch * shape.tiles_per_matrix();
  const void* xd = x.data(type);
  syrk_pack(xd, layout.batch_stride, layout.row, layout.col, shape, packed.data(), 0, panel_tasks / 2);
  syrk_pack(xd, layout.batch_stride, layout.row, layout.col, shape, packed.data(), panel_tasks / 2, panel_tasks);
  std::vector<float> partials(static_cast<std::size_t>(shape.partial_floats()), std::nanf(""));
  float* partial = partials.empty() ? nullptr : partials.data();
  syrk_tiles(packed.data(), shape, c.data(type), partial, 0, tiles / 3);
  syrk_tiles(packed.data(), shape, c.data(type), partial, tiles / 3, tiles);

  const double result_rounding = std::ldexp(1.0, type == SyrkType::kBf16 ? -8 : -24);
  // fp32 sums run in blocks of 32 steps added to a running total: about 32 + depth / 32 roundings
  // deep instead of depth (syrk_cpu.cpp). bf16 steps are pairs, accumulated in one chain.
  const double depth_roundings = type == SyrkType::kFp32 ? 32.0 + std::ceil(static_cast<double>(depth) / 32.0) + 2.0
                                                         : static_cast<double>(depth);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t base = b * layout.batch_stride;
    for (int64_t i = 0; i < side; ++i) {
      for (int64_t j = 0; j < side; ++j) {
        double exact = 0, magnitude = 0;
        for (int64_t k = 0; k < depth; ++k) {
          const double p = x.value(type, base + i * layout.row + k * layout.col) *
                           x.value(type, base + j * layout.row + k * layout.col);
          exact += p;
          magnitude += std::fabs(p);
        }
        const std::size_t at = static_cast<std::size_t>((b * side + i) * side + j);
        const std::size_t mirror = static_cast<std::size_t>((b * side + j) * side + i);
        ASSERT_EQ(c.bits(type, at), c.bits(type, mirror))
            << layout.name << " " << side << "x" << depth << " not symmetric at " << i << "," << j;
        // One rounding of the result plus fp32 accumulation over the depth.
        const double bound = result_rounding * std::fabs(exact) + depth_roundings * std::ldexp(magnitude, -23);
        ASSERT_LE(std::fabs(c.value(type, at) - exact), bound)
            << layout.name << " batch " << b << " " << side << "x" << depth << " at " << i << "," << j;
      }
    }
  }
}

TEST(SyrkCpu, TileCountCoversTheUpperTriangle) {
  // Column panel q (32 columns) takes the 8-row tiles of rows [0, min(side, 32 (q + 1))).
  EXPECT_EQ((SyrkShape{1, 1, 5, SyrkType::kBf16}.tiles_per_matrix()), 1);
  EXPECT_EQ((SyrkShape{1, 32, 5, SyrkType::kBf16}.tiles_per_matrix()), 4);
  EXPECT_EQ((SyrkShape{1, 33, 5, SyrkType::kFp32}.tiles_per_matrix()), 4 + 5);
  EXPECT_EQ((SyrkShape{1, 64, 5, SyrkType::kBf16}.tiles_per_matrix()), 4 + 8);
  EXPECT_EQ((SyrkShape{1, 768, 5, SyrkType::kFp32}.tiles_per_matrix()), 4 * 24 * 25 / 2);
  EXPECT_EQ((SyrkShape{3, 7, 5, SyrkType::kBf16}.packed_words()), 3 * 1 * 3 * 32);  // 3 pairs
  EXPECT_EQ((SyrkShape{3, 7, 5, SyrkType::kFp32}.packed_words()), 3 * 1 * 5 * 32);
}

class SyrkCpuTypes : public ::testing::TestWithParam<SyrkType> {};

TEST_P(SyrkCpuTypes, MatchesFloat64OnAwkwardShapesAndLayouts) {
  const SyrkType type = GetParam();
  if (!syrk_available(type)) GTEST_SKIP() << "this CPU lacks the kernel's AVX-512 extensions";
  std::mt19937 gen(20261125u);
  const int64_t shapes[][2] = {{1, 1},   {1, 7},   {7, 1},  {5, 3}, {8, 2},    {31, 97},  {32, 32},
                               {33, 65}, {40, 17}, {64, 2}, {5, 0}, {100, 37}, {129, 300}};  // {5, 0}: C = 0
  for (const auto& s : shapes) {
    for (int which = 0; which < 5; ++which) {
      check_product(type, 1, s[0], s[1], which, gen);
      if (HasFatalFailure()) return;
    }
  }
  for (int which = 0; which < 5; ++which) {
    check_product(type, 3, 45, 33, which, gen);
    if (HasFatalFailure()) return;
  }
  // Past one cache block: several depth chunks (128 fp32 or 512 bf16-pair words) and row blocks (128 rows), in a batch.
  for (int which = 0; which < 5; which += 2) {
    check_product(type, 2, 150, 1100, which, gen);
    if (HasFatalFailure()) return;
  }
  // Deep fp32 products, where a single accumulation chain would be 4000 roundings deep.
  if (type == SyrkType::kFp32) {
    check_product(type, 1, 40, 4000, 0, gen);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(BothTypes, SyrkCpuTypes, ::testing::Values(SyrkType::kBf16, SyrkType::kFp32),
                         [](const ::testing::TestParamInfo<SyrkType>& info) {
                           return info.param == SyrkType::kBf16 ? std::string("bf16") : std::string("fp32");
                         });

TEST(SyrkCpu, Bf16AccumulatesInFp32) {
  if (!syrk_available(SyrkType::kBf16)) GTEST_SKIP() << "this CPU has no AVX512-BF16";
  // 4096 equal products (1 + 2^-7)^2 sum to 4160.25, whose bf16 is 4160: a sum rounded to bf16 on
  // the way would stall at 512 (each addend is under half a bf16 step there); fp32 does not.
  const int64_t side = 3, depth = 4096;
  std::vector<Bf16> x(static_cast<std::size_t>(side * depth), from_float<Bf16>(1.0f + 1.0f / 128));
  const SyrkShape shape{1, side, depth, SyrkType::kBf16};
  std::vector<uint32_t> packed(static_cast<std::size_t>(shape.packed_words()));
  std::vector<Bf16> c(static_cast<std::size_t>(side * side));
  syrk_pack(x.data(), 0, depth, 1, shape, packed.data(), 0, shape.panels());
  std::vector<float> partials(static_cast<std::size_t>(shape.partial_floats()));
  syrk_tiles(packed.data(), shape, c.data(), partials.data(), 0, shape.tiles_per_matrix());
  const float exact = static_cast<float>(depth) * (1.0f + 1.0f / 128) * (1.0f + 1.0f / 128);
  for (const Bf16& v : c) EXPECT_EQ(v.bits, from_float<Bf16>(exact).bits);
}

}  // namespace
}  // namespace megatron_eopt
