// The operand-alignment rules of the cuBLASLt plan cache: what alignment a batch of matrices
// guarantees, and which cached plan may serve a call during CUDA-graph capture.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "megatron_eopt/gemm_alignment.h"

using megatron_eopt::alignment_serves;
using megatron_eopt::find_serving_plan;
using megatron_eopt::gemm_alignment;
using megatron_eopt::GemmAlignments;

TEST(GemmAlignment, LargestPowerOfTwoOfAddressAndStrideCappedAt256) {
  EXPECT_EQ(gemm_alignment(0x10000, 1024, 4), 256u);  // allocator base, large even stride
  EXPECT_EQ(gemm_alignment(0x10004, 1024, 4), 4u);    // a view one fp32 element in
  EXPECT_EQ(gemm_alignment(0x10000, 97 * 37, 2), 2u); // odd bf16 batch stride: matrices 2 apart
  EXPECT_EQ(gemm_alignment(0x10000, 37 * 40, 4), 32u);
  EXPECT_EQ(gemm_alignment(0x10010, 0, 4), 16u);      // batch of one (stride 0): the address alone
  EXPECT_EQ(gemm_alignment(0x10000, 0, 2), 256u);
  // Every matrix of the batch starts at a multiple of the result.
  for (uintptr_t base : {uintptr_t{0x20000}, uintptr_t{0x20002}, uintptr_t{0x20030}}) {
    for (int64_t stride : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{40}, int64_t{4096}}) {
      const uint32_t a = gemm_alignment(base, stride, 2);
      for (int64_t t = 0; t < 5; ++t) EXPECT_EQ((base + static_cast<uintptr_t>(t * stride * 2)) % a, 0u);
      EXPECT_LE(a, 256u);
    }
  }
}

TEST(GemmAlignment, APlanServesOperandsAtLeastAsAligned) {
  const GemmAlignments planned{4, 16, 16, 16};
  EXPECT_TRUE(alignment_serves(planned, {4, 16, 16, 16}));
  EXPECT_TRUE(alignment_serves(planned, {256, 256, 256, 256}));
  EXPECT_FALSE(alignment_serves(planned, {2, 16, 16, 16}));
  EXPECT_FALSE(alignment_serves(planned, {256, 256, 256, 8}));
  EXPECT_FALSE(alignment_serves({256, 256, 256, 256}, {4, 256, 256, 256}));
}

TEST(GemmAlignment, CaptureFindsAPlanOfTheSameProblemChosenForLessAlignedOperands) {
  // The cache's shape: (problem, alignments) -> plan id, ordered; a problem's plans are adjacent.
  using Key = std::pair<int, GemmAlignments>;
  std::map<Key, int> cache{{{1, {4, 4, 256, 256}}, 10}, {{1, {256, 256, 256, 256}}, 11}, {{2, {2, 2, 2, 2}}, 20}};
  auto find = [&](int problem, const GemmAlignments& actual) {
    auto first = cache.lower_bound(Key{problem, GemmAlignments{}});
    auto last = first;
    while (last != cache.end() && last->first.first == problem) ++last;
    auto it = find_serving_plan(first, last, actual, [](const auto& e) { return e.first.second; });
    return it == last ? -1 : it->second;
  };
  EXPECT_EQ(find(1, {256, 256, 256, 256}), 11);  // the exact plan (the most aligned that serves)
  EXPECT_EQ(find(1, {16, 16, 256, 256}), 10);    // warm-up on a 4-byte-aligned view serves a 16-byte capture
  EXPECT_EQ(find(1, {2, 16, 256, 256}), -1);     // less aligned than any plan: none
  EXPECT_EQ(find(2, {256, 256, 256, 256}), 20);
  EXPECT_EQ(find(3, {256, 256, 256, 256}), -1);  // another problem is never used
}
