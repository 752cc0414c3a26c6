// The mirror of a symmetric product's lower column panels (mirror_cpu.h): the AVX-512 path (where
// the CPU runs it) and the portable one against a plain copy, bit for bit, on sides off the 16 x 16
// tiles, padded rows, block edges that are not multiples of 16, and row ranges as the threads take
// them.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cpu/avx512_cpu.h"
#include "cpu/mirror_cpu.h"

namespace megatron_eopt {
namespace {

template <typename Bits>
void check_mirror(int64_t side, int64_t blocks, int64_t pad, int64_t range_rows, bool portable, std::mt19937& gen) {
  const int64_t ld = side + pad;
  std::vector<Bits> d(static_cast<std::size_t>(side * ld));
  std::uniform_int_distribution<uint32_t> bits;
  for (Bits& v : d) v = static_cast<Bits>(bits(gen));
  const auto edge = [side, blocks](int64_t i) { return side * i / blocks; };
  std::vector<int64_t> from(static_cast<std::size_t>(side));
  for (int64_t i = 0; i < blocks; ++i) {
    for (int64_t r = edge(i); r < edge(i + 1); ++r) from[static_cast<std::size_t>(r)] = edge(i + 1);
  }
  std::vector<Bits> expected = d;
  for (int64_t r = 0; r < side; ++r) {
    for (int64_t c = from[static_cast<std::size_t>(r)]; c < side; ++c) expected[r * ld + c] = d[c * ld + r];
  }
  // The ranges in reverse order, as a thread may take them.
  const int64_t rows = blocks > 0 ? edge(blocks - 1) : 0;
  for (int64_t begin = (rows - 1) / range_rows * range_rows; begin >= 0; begin -= range_rows) {
    mirror_above_blocks_rows(d.data(), sizeof(Bits), ld, side, from.data(), begin, std::min(rows, begin + range_rows),
                             portable);
  }
  for (int64_t r = 0; r < side; ++r) {
    for (int64_t c = 0; c < ld; ++c) {
      ASSERT_EQ(d[r * ld + c], expected[r * ld + c])
          << (portable ? "portable" : "avx512") << " " << sizeof(Bits) << "-byte side " << side << " blocks " << blocks
          << " pad " << pad << " at " << r << "," << c;
    }
  }
}

TEST(MirrorCpu, BothPathsCopyTheLowerBlocksBitForBit) {
  std::mt19937 gen(20261128u);
  const int64_t cases[][3] = {{1, 1, 0},   {2, 2, 0},   {17, 2, 3},   {40, 3, 0},   {256, 1, 0},
                              {300, 2, 5}, {513, 2, 0}, {768, 3, 16}, {1000, 3, 1}, {777, 7, 2}};
  for (const bool portable : {true, false}) {
    for (const auto& c : cases) {
      for (const int64_t range_rows : {int64_t{32}, int64_t{1} << 20}) {
        check_mirror<uint32_t>(c[0], c[1], c[2], range_rows, portable, gen);
        if (HasFatalFailure()) return;
        check_mirror<uint16_t>(c[0], c[1], c[2], range_rows, portable, gen);
        if (HasFatalFailure()) return;
      }
    }
  }
  if (!cpu_runs_avx512()) GTEST_SKIP() << "this CPU lacks AVX-512 F/BW/VL: the portable path ran twice";
}

}  // namespace
}  // namespace megatron_eopt
