// The low-memory state formats (state_quantization.h): grids, stochastic rounding, block scales,
// block layout.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <vector>

#include "megatron_eopt/quantized_state_ops.h"
#include "megatron_eopt/state_quantization.h"

using namespace megatron_eopt;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

float draw(uint64_t seed, uint64_t index) { return uniform_from_bits(random_bits(seed, 0, index)); }

// Every finite e4m3fn value, ascending (from the 256 codes).
std::vector<float> e4m3_grid() {
  std::set<float> values;
  for (int code = 0; code < 256; ++code) {
    const float v = e4m3_to_float(Fp8E4M3{static_cast<uint8_t>(code)});
    if (!std::isnan(v)) values.insert(v);
  }
  return {values.begin(), values.end()};
}

}  // namespace

TEST(StateQuantization, UniformDrawsAreInUnitIntervalAndSpread) {
  double sum = 0.0;
  int low = 0;
  constexpr int kDraws = 100000;
  for (int i = 0; i < kDraws; ++i) {
    const float u = draw(7, i);
    ASSERT_GE(u, 0.f);
    ASSERT_LT(u, 1.f);
    sum += u;
    low += u < 0.25f;
  }
  EXPECT_NEAR(sum / kDraws, 0.5, 0.01);
  EXPECT_NEAR(low / double(kDraws), 0.25, 0.01);
  // Same inputs, same bits; another seed, stream or index, other bits.
  EXPECT_EQ(random_bits(3, 1, 99), random_bits(3, 1, 99));
  EXPECT_NE(random_bits(3, 1, 99), random_bits(4, 1, 99));
  EXPECT_NE(random_bits(3, 1, 99), random_bits(3, 2, 99));
  EXPECT_NE(random_bits(3, 1, 99), random_bits(3, 1, 100));
  EXPECT_EQ(uniform_from_bits(0xFFFFFFFFu), 1.f - 5.9604644775390625e-08f);
}

TEST(StateQuantization, Bf16StochasticPicksANeighbourWithoutBias) {
  const float x = 1.00302f;  // between 1 and 1 + 2^-7
  const float lo = 1.f, hi = 1.0078125f;
  double mean = 0.0;
  constexpr int kDraws = 200000;
  for (int i = 0; i < kDraws; ++i) {
    const float r = to_float(bf16_stochastic(x, random_bits(11, 0, i)));
    ASSERT_TRUE(r == lo || r == hi) << r;
    mean += r;
  }
  EXPECT_NEAR(mean / kDraws, x, 2e-5);
  // Representable values, infinities and NaN are kept.
  for (uint32_t bits : {0u, 0xFFFFu, 0x12345678u}) {
    EXPECT_EQ(to_float(bf16_stochastic(1.5f, bits)), 1.5f);
    EXPECT_EQ(to_float(bf16_stochastic(-kInf, bits)), -kInf);
    EXPECT_TRUE(std::isnan(to_float(bf16_stochastic(kNaN, bits))));
  }
  // Negative values round in magnitude like positive ones.
  EXPECT_EQ(to_float(bf16_stochastic(-x, 0u)), -lo);
  EXPECT_EQ(to_float(bf16_stochastic(-x, 0xFFFFu)), -hi);
}

TEST(StateQuantization, E4M3CodesDecodeToTheFormat) {
  EXPECT_EQ(e4m3_to_float(Fp8E4M3{0x7E}), 448.f);
  EXPECT_EQ(e4m3_to_float(Fp8E4M3{0xFE}), -448.f);
  EXPECT_EQ(e4m3_to_float(Fp8E4M3{0x38}), 1.f);
  EXPECT_EQ(e4m3_to_float(Fp8E4M3{0x08}), 0.015625f);        // smallest normal 2^-6
  EXPECT_EQ(e4m3_to_float(Fp8E4M3{0x01}), 0.001953125f);     // smallest subnormal 2^-9
  EXPECT_EQ(e4m3_to_float(Fp8E4M3{0x07}), 7 * 0.001953125f);  // largest subnormal
  EXPECT_TRUE(std::isnan(e4m3_to_float(Fp8E4M3{0x7F})));
  EXPECT_TRUE(std::isnan(e4m3_to_float(Fp8E4M3{0xFF})));
  const std::vector<float> grid = e4m3_grid();
  EXPECT_EQ(grid.size(), 253u);  // 254 finite codes, +0 and -0 equal
  // Every grid value is kept by the stochastic rounding, whatever the draw.
  for (float v : grid) {
    for (uint32_t bits : {0u, 0x7FFFFu, 0xFFFFFu, 0xDEADBEEFu}) {
      EXPECT_EQ(e4m3_to_float(e4m3_stochastic(v, bits)), v) << v;
      EXPECT_EQ(e4m3_to_float(e4m3_stochastic(-v, bits)), -v) << v;
    }
  }
}

TEST(StateQuantization, E4M3StochasticRoundsToNeighboursWithoutBias) {
  const std::vector<float> grid = e4m3_grid();
  for (float x : {0.0009f, -0.0043f, 0.0155f, 0.0173f, 0.3f, 1.06f, -5.3f, 100.f, 447.f}) {
    auto above = std::lower_bound(grid.begin(), grid.end(), x);
    const float hi = *above;
    const float lo = hi == x ? x : *(above - 1);
    double mean = 0.0;
    constexpr int kDraws = 100000;
    for (int i = 0; i < kDraws; ++i) {
      const float r = e4m3_to_float(e4m3_stochastic(x, random_bits(5, 0, i)));
      ASSERT_TRUE(r == lo || r == hi) << x << " -> " << r;
      mean += r;
    }
    EXPECT_NEAR(mean / kDraws, x, 0.01 * (hi - lo) + 1e-7) << x;
  }
  // The top is clamped, zero and tiny values stay finite, NaN is NaN.
  EXPECT_EQ(e4m3_to_float(e4m3_stochastic(448.02f, 0xFFFFFu)), 448.f);
  EXPECT_EQ(e4m3_to_float(e4m3_stochastic(447.9f, 0xFFFFFu)), 448.f);
  EXPECT_EQ(e4m3_to_float(e4m3_stochastic(0.f, 0xFFFFFu)), 0.f);
  EXPECT_EQ(e4m3_to_float(e4m3_stochastic(1e-30f, 0xFFFFFu)), 0.f);
  EXPECT_EQ(e4m3_to_float(e4m3_stochastic(0.0156f, 0xFFFFFu)), 0.015625f);  // up across 2^-6
  EXPECT_TRUE(std::isnan(e4m3_to_float(e4m3_stochastic(kNaN, 0x12345u))));
}

TEST(StateQuantization, BlockScales) {
  const BlockScale i8 = block_scale(2.54f, StateFormat::kInt8);
  EXPECT_FLOAT_EQ(i8.scale, 0.02f);
  EXPECT_FLOAT_EQ(i8.inverse, 50.f);
  const BlockScale f8 = block_scale(4.48f, StateFormat::kFloat8E4M3);
  EXPECT_FLOAT_EQ(f8.scale, 0.01f);
  // A zero block and a block below fp32's normals store zeros; a non-finite block reads as NaN.
  for (float absmax : {0.f, 1e-39f, 1e-45f}) {
    const BlockScale z = block_scale(absmax, StateFormat::kInt8);
    EXPECT_EQ(z.scale, 0.f);
    EXPECT_EQ(z.inverse, 0.f);
  }
  EXPECT_TRUE(std::isnan(block_scale(kInf, StateFormat::kInt8).scale));
  EXPECT_TRUE(std::isnan(block_scale(kNaN, StateFormat::kFloat8E4M3).scale));
  // absmax keeps NaN once seen.
  float a = 0.f;
  for (float x : {1.f, -3.f, kNaN, 7.f}) a = absmax_update(a, x);
  EXPECT_TRUE(std::isnan(a));
  a = 0.f;
  for (float x : {1.f, -3.f, 2.f}) a = absmax_update(a, x);
  EXPECT_EQ(a, 3.f);
}

TEST(StateQuantization, Int8RoundTripWithinOneStepAndUnbiased) {
  const std::vector<float> block = {0.5f, -1.27f, 0.003f, 1e-9f, -0.7777f, 0.f};
  float absmax = 0.f;
  for (float x : block) absmax = absmax_update(absmax, x);
  const BlockScale s = block_scale(absmax, StateFormat::kInt8);
  std::vector<double> mean(block.size(), 0.0);
  constexpr int kDraws = 50000;
  for (int d = 0; d < kDraws; ++d) {
    for (std::size_t i = 0; i < block.size(); ++i) {
      const int8_t q = int8_stochastic(block[i], s.inverse, draw(d, i));
      ASSERT_GE(q, -127);
      ASSERT_LE(q, 127);
      const float back = int8_value(q, s.scale);
      ASSERT_LE(std::fabs(back - block[i]), s.scale * 1.0001f);
      mean[i] += back;
    }
  }
  for (std::size_t i = 0; i < block.size(); ++i) EXPECT_NEAR(mean[i] / kDraws, block[i], 0.01 * s.scale) << i;
  // The absmax value itself is exact; a NaN block (inverse 0) stores 0 and reads back as NaN.
  EXPECT_EQ(int8_stochastic(-1.27f, s.inverse, 0.99f), -127);
  const BlockScale nan_block = block_scale(kNaN, StateFormat::kInt8);
  EXPECT_EQ(int8_stochastic(kNaN, nan_block.inverse, 0.5f), 0);
  EXPECT_TRUE(std::isnan(int8_value(0, nan_block.scale)));
}

// The momentum's squared fp8 codes: the grid is r_c = sqrt(e4m3(c)) (in units of the block scale,
// r_0x7E = sqrt(448) at the block's max), every grid value is kept, any other value goes to one of
// its two neighbours without bias, and the grid is twice as fine as plain e4m3's where momentum
// values live.
TEST(StateQuantization, E4M3SquaredRoundsToNeighboursWithoutBias) {
  std::vector<float> grid;
  for (uint32_t c = 0; c <= 0x7Eu; ++c) grid.push_back(e4m3_root(c));
  ASSERT_TRUE(std::is_sorted(grid.begin(), grid.end()));
  EXPECT_EQ(grid.back(), kE4M3MaxRoot);
  EXPECT_TRUE(std::isnan(e4m3_root(0x7Fu)));
  // Every grid value is kept, with its sign, whatever the draw.
  for (uint32_t c = 0; c <= 0x7Eu; ++c) {
    for (float u : {0.f, 0.5f, 0.99999994f}) {
      EXPECT_EQ(e4m3_squared_stochastic(grid[c], 1.f, u).bits, c) << c;
      EXPECT_EQ(e4m3_squared_stochastic(-grid[c], 1.f, u).bits, c | 0x80u) << c;
    }
  }
  // Unbiased between neighbours, in the value domain, across the whole range (subnormal codes,
  // the 2^-6 crossing, values a hair above a grid point and the top).
  const BlockScale s = block_scale(2.f, StateFormat::kFloat8E4M3Squared);
  EXPECT_FLOAT_EQ(s.scale, 2.f / kE4M3MaxRoot);
  for (float x : {1e-4f, 0.0031f, 0.011f, 0.0125f, 0.2f, -0.35f, 0.7071f, 1.3f, -1.93f, 1.9999f}) {
    const float t = std::fabs(x) * s.inverse;
    auto above = std::upper_bound(grid.begin(), grid.end(), t);
    const float lo = *(above - 1) * s.scale, hi = (above == grid.end() ? *(above - 1) : *above) * s.scale;
    double mean = 0.0;
    constexpr int kDraws = 100000;
    for (int i = 0; i < kDraws; ++i) {
      const float r = e4m3_squared_value(e4m3_squared_stochastic(x, s.inverse, draw(9, i)), s.scale);
      ASSERT_TRUE(std::fabs(r) == lo || std::fabs(r) == hi) << x << " -> " << r << " not " << lo << " / " << hi;
      ASSERT_EQ(std::signbit(r), std::signbit(x));
      mean += r;
    }
    EXPECT_NEAR(mean / kDraws, x, 0.01 * (hi - lo) + 1e-7) << x;
  }
  // The block's max is exact; a NaN block stores 0 and reads back as NaN; zero stays zero.
  EXPECT_EQ(e4m3_squared_value(e4m3_squared_stochastic(-2.f, s.inverse, 0.999f), s.scale), -2.f);
  const BlockScale nan_block = block_scale(kNaN, StateFormat::kFloat8E4M3Squared);
  EXPECT_EQ(e4m3_squared_stochastic(kNaN, nan_block.inverse, 0.5f).bits, 0u);
  EXPECT_TRUE(std::isnan(e4m3_squared_value(Fp8E4M3{0}, nan_block.scale)));
  EXPECT_EQ(e4m3_squared_value(e4m3_squared_stochastic(0.f, s.inverse, 0.999f), s.scale), 0.f);
  // Relative spacing: at most 6.25% from 1/128 of the block's max up (plain e4m3: up to 12.5%).
  for (std::size_t c = 1; c + 1 < grid.size(); ++c) {
    if (grid[c] >= kE4M3MaxRoot / 128.f) EXPECT_LE(grid[c + 1] / grid[c] - 1.f, 0.0625f) << c;
  }
}

TEST(StateQuantization, StoreAndLoadThroughEachFormat) {
  const float x = 0.3f;
  const BlockScale i8 = block_scale(1.f, StateFormat::kInt8);
  const BlockScale f8 = block_scale(1.f, StateFormat::kFloat8E4M3);
  int8_t q8 = 0;
  Fp8E4M3 qf{0};
  Bf16 qb{0};
  store_state<StateFormat::kInt8>(&q8, 0, x, i8.inverse, 0u);
  store_state<StateFormat::kFloat8E4M3>(&qf, 0, x, f8.inverse, 0u);
  store_state<StateFormat::kBFloat16>(&qb, 0, x, 0.f, 0u);
  const BlockScale sq = block_scale(1.f, StateFormat::kFloat8E4M3Squared);
  Fp8E4M3 qs{0};
  store_state<StateFormat::kFloat8E4M3Squared>(&qs, 0, x, sq.inverse, 0u);
  // 0.3 * sqrt(448) = 6.35; 6.35^2 = 40.3 lies in e4m3's [40, 44): the grid value below is sqrt(40).
  EXPECT_FLOAT_EQ(load_state<StateFormat::kFloat8E4M3Squared>(&qs, 0, sq.scale), std::sqrt(40.f) / kE4M3MaxRoot);
  // Draw 0 rounds down: the grid value at or below x.
  EXPECT_FLOAT_EQ(load_state<StateFormat::kInt8>(&q8, 0, i8.scale), 38.f / 127.f);
  EXPECT_FLOAT_EQ(load_state<StateFormat::kFloat8E4M3>(&qf, 0, f8.scale), 128.f / 448.f);
  EXPECT_FLOAT_EQ(load_state<StateFormat::kBFloat16>(&qb, 0, 0.f), 0.298828125f);
  // The second moment is stored as sqrt(v) in e4m3, as v in bf16.
  EXPECT_FLOAT_EQ(moment2_stored<StateFormat::kFloat8E4M3>(0.25f), 0.5f);
  EXPECT_FLOAT_EQ(moment2_from_stored<StateFormat::kFloat8E4M3>(0.5f), 0.25f);
  EXPECT_FLOAT_EQ(moment2_stored<StateFormat::kBFloat16>(0.25f), 0.25f);
}

TEST(StateQuantization, BlocksStayWithinRows) {
  const BlockLayout layout{300, 256};
  EXPECT_EQ(layout.blocks_per_row(), 2);
  EXPECT_EQ(layout.blocks(3 * 300), 6);
  int64_t begin, end;
  layout.range(0, begin, end);
  EXPECT_EQ(begin, 0);
  EXPECT_EQ(end, 256);
  layout.range(1, begin, end);
  EXPECT_EQ(begin, 256);
  EXPECT_EQ(end, 300);
  layout.range(3, begin, end);  // row 1, second block
  EXPECT_EQ(begin, 556);
  EXPECT_EQ(end, 600);
  // A column vector: one block per element; a zero-length row: no blocks.
  EXPECT_EQ((BlockLayout{1, 256}.blocks(97)), 97);
  EXPECT_EQ((BlockLayout{0, 256}.blocks(0)), 0);
  // Exactly divisible rows.
  EXPECT_EQ((BlockLayout{512, 256}.blocks(2 * 512)), 4);
  EXPECT_NE(draw_stream(3, 0), draw_stream(3, 1));
  EXPECT_NE(draw_stream(3, 1), draw_stream(4, 0));
}

// Every box of a stack of matrices maps its elements to their indices in the whole stack, so a
// shard draws what the whole tensor draws at the same element: compare each shard's indices with
// the whole stack's, for shards along every dim (experts, rows, columns) and uneven sizes.
TEST(StateQuantization, DrawIndexOfShardsMatchesTheWholeTensor) {
  const int64_t experts = 3, rows = 5, cols = 7;
  auto whole = [&](int64_t e, int64_t r, int64_t c) { return static_cast<uint64_t>((e * rows + r) * cols + c); };
  struct Box {
    int64_t e0, ne, r0, nr, c0, nc;
  };
  const Box boxes[] = {{0, 3, 0, 5, 0, 7}, {1, 2, 0, 5, 0, 7}, {0, 3, 3, 2, 0, 7},
                       {0, 3, 0, 5, 4, 3}, {2, 1, 1, 3, 2, 4}, {0, 1, 4, 1, 6, 1}};
  for (const Box& b : boxes) {
    const DrawIndex index{b.nr, rows, cols, (b.e0 * rows + b.r0) * cols + b.c0};
    for (int64_t e = 0; e < b.ne; ++e) {
      for (int64_t r = 0; r < b.nr; ++r) {
        for (int64_t c = 0; c < b.nc; ++c) {
          const int64_t local = (e * b.nr + r) * b.nc + c;
          EXPECT_EQ(index.of(local, b.nc), whole(b.e0 + e, b.r0 + r, b.c0 + c))
              << "box e0=" << b.e0 << " r0=" << b.r0 << " c0=" << b.c0 << " local " << local;
        }
      }
    }
  }
  // The identity (no layout given): element i draws at i.
  EXPECT_EQ(DrawIndex{}.of(41, 7), 41u);
  // Indices past 2^32 (a parameter of more than 2^32 elements) keep their high bits.
  const DrawIndex big{2, 1 << 20, 1 << 14, int64_t{1} << 33};
  EXPECT_EQ(big.of(3, 1 << 14), (uint64_t{1} << 33) + 3u);
  // Draws of the same element through two layouts are the same bits; of neighbours, not.
  const uint64_t key = draw_key(11, draw_stream(5, 0));
  EXPECT_EQ(element_bits(key, DrawIndex{2, rows, cols, 3 * cols}.of(1, cols)),
            element_bits(key, DrawIndex{}.of(3 * cols + 1, cols)));
  EXPECT_NE(element_bits(key, 3 * cols + 1), element_bits(key, 3 * cols + 2));
}
