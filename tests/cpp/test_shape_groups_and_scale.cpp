#include <gtest/gtest.h>

#include <cmath>

#include "megatron_eopt/scale.h"
#include "megatron_eopt/shape_groups.h"

using namespace megatron_eopt;

TEST(ShapeGroups, GroupsInOrderOfFirstAppearance) {
  const auto groups = group_by_shape({{4, 8}, {2, 3}, {4, 8}, {8, 4}, {2, 3}, {4, 8}});
  ASSERT_EQ(groups.size(), 3u);
  EXPECT_EQ(groups[0], (std::vector<std::size_t>{0, 2, 5}));
  EXPECT_EQ(groups[1], (std::vector<std::size_t>{1, 4}));
  EXPECT_EQ(groups[2], (std::vector<std::size_t>{3}));
}

TEST(ShapeGroups, EmptyAndSingle) {
  EXPECT_TRUE(group_by_shape({}).empty());
  const auto one = group_by_shape({{1, 5}});
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0], (std::vector<std::size_t>{0}));
}

TEST(ScaleFactor, Modes) {
  EXPECT_DOUBLE_EQ(muon_scale_factor(1024, 4096, ScaleMode::kSpectral), 64.0);
  EXPECT_DOUBLE_EQ(muon_scale_factor(4096, 1024, ScaleMode::kShapeScaling), 2.0);
  EXPECT_DOUBLE_EQ(muon_scale_factor(1024, 4096, ScaleMode::kShapeScaling), 1.0);
  EXPECT_DOUBLE_EQ(muon_scale_factor(1024, 4096, ScaleMode::kUnitRmsNorm), 0.5);
  EXPECT_DOUBLE_EQ(muon_scale_factor(97, 37, ScaleMode::kUnitRmsNorm), std::sqrt(97.0 / 37.0));
}

TEST(ScaleFactor, ParsesNamesAndRejectsUnknown) {
  EXPECT_EQ(parse_scale_mode("spectral"), ScaleMode::kSpectral);
  EXPECT_EQ(parse_scale_mode("shape_scaling"), ScaleMode::kShapeScaling);
  EXPECT_EQ(parse_scale_mode("unit_rms_norm"), ScaleMode::kUnitRmsNorm);
  EXPECT_THROW(parse_scale_mode("rms"), std::invalid_argument);
}
