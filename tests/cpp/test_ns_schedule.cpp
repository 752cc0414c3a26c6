#include <gtest/gtest.h>

#include "megatron_eopt/ns_schedule.h"

using megatron_eopt::expand_schedule;
using megatron_eopt::SchedulePolicy;

namespace {
const std::vector<double> kTwoRows = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0};
}

TEST(NsSchedule, CycleWrapsAround) {
  const auto s = expand_schedule(kTwoRows, 5, SchedulePolicy::kCycle);
  ASSERT_EQ(s.size(), 5u);
  const float expected_a[] = {1, 4, 1, 4, 1};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s[i].a, expected_a[i]) << "step " << i;
  EXPECT_EQ(s[3].b, 5.f);
  EXPECT_EQ(s[4].c, 3.f);
}

TEST(NsSchedule, RepeatLastHoldsTheFinalRow) {
  const auto s = expand_schedule(kTwoRows, 4, SchedulePolicy::kRepeatLast);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].a, 1.f);
  for (int i = 1; i < 4; ++i) {
    EXPECT_EQ(s[i].a, 4.f);
    EXPECT_EQ(s[i].c, 6.f);
  }
}

TEST(NsSchedule, ShorterThanTableTakesAPrefix) {
  for (auto policy : {SchedulePolicy::kCycle, SchedulePolicy::kRepeatLast}) {
    const auto s = expand_schedule(kTwoRows, 1, policy);
    ASSERT_EQ(s.size(), 1u);
    EXPECT_EQ(s[0].b, 2.f);
  }
}

TEST(NsSchedule, RejectsBadInput) {
  EXPECT_THROW(expand_schedule({}, 3, SchedulePolicy::kCycle), std::invalid_argument);
  EXPECT_THROW(expand_schedule({1.0, 2.0}, 3, SchedulePolicy::kCycle), std::invalid_argument);
  EXPECT_THROW(expand_schedule(kTwoRows, 0, SchedulePolicy::kCycle), std::invalid_argument);
  EXPECT_THROW(expand_schedule({1.0, NAN, 2.0}, 1, SchedulePolicy::kCycle), std::invalid_argument);
}
