#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "megatron_eopt/split_layout.h"

using megatron_eopt::plan_split;

namespace {
std::string error_of(int64_t rows, const std::vector<int64_t>& sizes, int64_t groups) {
  try {
    plan_split(rows, sizes, groups);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(SplitLayout, QkvGroupsEqualSizesTogether) {
  // 4 query groups of [q=8, k=4, v=4]: k and v share one batch.
  const auto layout = plan_split(4 * 16, {8, 4, 4}, 4);
  EXPECT_EQ(layout.group_rows, 16);
  EXPECT_EQ(layout.offsets, (std::vector<int64_t>{0, 8, 12}));
  ASSERT_EQ(layout.same_size.size(), 2u);
  EXPECT_EQ(layout.same_size[0].size, 8);
  EXPECT_EQ(layout.same_size[0].parts, (std::vector<std::size_t>{0}));
  EXPECT_EQ(layout.same_size[1].size, 4);
  EXPECT_EQ(layout.same_size[1].parts, (std::vector<std::size_t>{1, 2}));
}

TEST(SplitLayout, GatedQkvAndPerHead) {
  const auto gated = plan_split(2 * 24, {8, 8, 4, 4}, 2);
  EXPECT_EQ(gated.offsets, (std::vector<int64_t>{0, 8, 16, 20}));
  ASSERT_EQ(gated.same_size.size(), 2u);
  EXPECT_EQ(gated.same_size[0].parts, (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(gated.same_size[1].parts, (std::vector<std::size_t>{2, 3}));

  const auto heads = plan_split(30, {5, 5, 5, 5, 5, 5}, 1);
  ASSERT_EQ(heads.same_size.size(), 1u);
  EXPECT_EQ(heads.same_size[0].parts.size(), 6u);
  EXPECT_EQ(heads.offsets.back(), 25);
}

TEST(SplitLayout, RejectsBadArgumentsByName) {
  EXPECT_NE(error_of(10, {}, 1).find("split_sizes must not be empty"), std::string::npos);
  EXPECT_NE(error_of(10, {5, 0, 5}, 1).find("split_sizes[1] must be positive"), std::string::npos);
  EXPECT_NE(error_of(10, {5, -5}, 1).find("split_sizes[1]"), std::string::npos);
  EXPECT_NE(error_of(10, {5, 5}, 0).find("num_groups must be positive"), std::string::npos);
  EXPECT_NE(error_of(30, {5, 5}, 2).find("num_groups * sum(split_sizes) = 2 * 10"), std::string::npos);
  EXPECT_NE(error_of(25, {5, 5}, 2).find("25 rows"), std::string::npos);
  EXPECT_EQ(error_of(20, {5, 5}, 2), "");
}
