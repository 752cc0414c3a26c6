#include <gtest/gtest.h>

#include <stdexcept>

#include "megatron_eopt/tensor_list_plan.h"

using megatron_eopt::plan_tensor_list;

TEST(TensorListPlan, BlocksPerTensorAreCappedAndPrefixed) {
  const auto plan = plan_tensor_list({1000, 1, 0, 100000}, 256, 64);
  EXPECT_EQ(plan.blocks, (std::vector<int64_t>{4, 1, 0, 64}));
  EXPECT_EQ(plan.first_block, (std::vector<int64_t>{0, 4, 5, 5}));
  EXPECT_EQ(plan.total_blocks, 69);
  ASSERT_EQ(plan.launches.size(), 1u);
  EXPECT_EQ(plan.launches[0], (std::vector<std::size_t>{0, 1, 3}));  // no launch slot for empty tensors
}

TEST(TensorListPlan, LaunchesHoldAtMostTheCapacity) {
  std::vector<int64_t> work(70, 10);
  work[5] = 0;
  const auto plan = plan_tensor_list(work, 4, 8, 32);
  ASSERT_EQ(plan.launches.size(), 3u);
  EXPECT_EQ(plan.launches[0].size(), 32u);
  EXPECT_EQ(plan.launches[1].size(), 32u);
  EXPECT_EQ(plan.launches[2].size(), 5u);
  EXPECT_EQ(plan.launches[0].front(), 0u);
  EXPECT_EQ(plan.launches[0][5], 6u);  // tensor 5 skipped
  EXPECT_EQ(plan.launches[2].back(), 69u);
  EXPECT_EQ(plan.total_blocks, 69 * 3);
  EXPECT_EQ(plan.first_block[69], 68 * 3);
}

TEST(TensorListPlan, LargeTensorsUse64BitWork) {
  const int64_t huge = int64_t{3} << 31;  // more than 2^31 elements
  const auto plan = plan_tensor_list({huge}, 2048, 1024);
  EXPECT_EQ(plan.blocks[0], 1024);
}

TEST(TensorListPlan, EmptyListAndBadArguments) {
  const auto plan = plan_tensor_list({}, 1, 1);
  EXPECT_TRUE(plan.launches.empty());
  EXPECT_EQ(plan.total_blocks, 0);
  EXPECT_THROW(plan_tensor_list({1}, 0, 1), std::invalid_argument);
  EXPECT_THROW(plan_tensor_list({-1}, 1, 1), std::invalid_argument);
}
