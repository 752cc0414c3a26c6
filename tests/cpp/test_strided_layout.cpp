#include <gtest/gtest.h>

#include "megatron_eopt/strided_layout.h"

using megatron_eopt::has_internal_overlap;
using megatron_eopt::non_overlapping_and_dense;

TEST(StridedLayout, ContiguousAndPermutedAreDense) {
  EXPECT_TRUE(non_overlapping_and_dense({3, 4}, {4, 1}));
  EXPECT_TRUE(non_overlapping_and_dense({3, 4}, {1, 3}));           // a transposed (4, 3)
  EXPECT_TRUE(non_overlapping_and_dense({2, 3, 4}, {12, 1, 3}));    // batch of transposed matrices
  EXPECT_TRUE(non_overlapping_and_dense({1, 5}, {999, 1}));         // size-1 dims: any stride
  EXPECT_TRUE(non_overlapping_and_dense({7}, {1}));
  EXPECT_TRUE(non_overlapping_and_dense({}, {}));                   // 0-dim
}

TEST(StridedLayout, GapsAndSlicesAreNotDense) {
  EXPECT_FALSE(non_overlapping_and_dense({3, 4}, {8, 1}));   // every other row of a (6, 4)
  EXPECT_FALSE(non_overlapping_and_dense({3, 2}, {4, 1}));   // a column slice
  EXPECT_FALSE(non_overlapping_and_dense({4}, {2}));
}

TEST(StridedLayout, InternalOverlapOnlyForExpandedDims) {
  EXPECT_TRUE(has_internal_overlap({3, 4}, {0, 1}));    // expanded rows
  EXPECT_TRUE(has_internal_overlap({5}, {0}));
  EXPECT_FALSE(has_internal_overlap({1, 4}, {0, 1}));   // a single row may have stride 0
  EXPECT_FALSE(has_internal_overlap({3, 4}, {8, 1}));   // gaps, no sharing
  EXPECT_FALSE(has_internal_overlap({3, 4}, {1, 3}));
}
