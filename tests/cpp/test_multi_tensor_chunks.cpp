#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "megatron_eopt/multi_tensor_chunks.h"

using namespace megatron_eopt;

namespace {

// Elements covered by all launches, per tensor, checking each entry's block numbering on the way.
std::vector<int64_t> covered(const std::vector<ChunkLaunch>& launches, std::size_t tensors, int64_t chunk) {
  std::vector<int64_t> seen(tensors, 0);
  for (const ChunkLaunch& launch : launches) {
    uint32_t next_block = 0;
    for (const ChunkEntry& e : launch.entries) {
      EXPECT_EQ(e.first_block, next_block);
      EXPECT_EQ(e.begin % chunk, 0);
      EXPECT_EQ(e.begin, seen[e.tensor]) << "entries of a tensor must be consecutive";
      EXPECT_GT(e.end, e.begin);
      next_block += static_cast<uint32_t>(chunk_count(e.end - e.begin, chunk));
      seen[e.tensor] = e.end;
    }
    EXPECT_EQ(launch.blocks, next_block);
  }
  return seen;
}

}  // namespace

TEST(MultiTensorChunks, ChunkBoundaries) {
  const std::vector<int64_t> numels = {1, kChunkElems - 1, kChunkElems, kChunkElems + 1, 3 * kChunkElems};
  const auto launches = plan_chunk_launches(numels, kChunkElems, 64, kMaxBlocksPerLaunch);
  ASSERT_EQ(launches.size(), 1u);
  const auto& entries = launches[0].entries;
  ASSERT_EQ(entries.size(), numels.size());
  const std::vector<uint32_t> first = {0, 1, 2, 3, 5};
  for (std::size_t t = 0; t < numels.size(); ++t) {
    EXPECT_EQ(entries[t].tensor, t);
    EXPECT_EQ(entries[t].begin, 0);
    EXPECT_EQ(entries[t].end, numels[t]);
    EXPECT_EQ(entries[t].first_block, first[t]);
  }
  EXPECT_EQ(launches[0].blocks, 8u);  // 1 + 1 + 1 + 2 + 3
  EXPECT_EQ(covered(launches, numels.size(), kChunkElems), numels);
}

TEST(MultiTensorChunks, EmptyTensorsAreSkipped) {
  const std::vector<int64_t> numels = {0, 5, 0, 0, 7, 0};
  const auto launches = plan_chunk_launches(numels, kChunkElems, 64, kMaxBlocksPerLaunch);
  ASSERT_EQ(launches.size(), 1u);
  ASSERT_EQ(launches[0].entries.size(), 2u);
  EXPECT_EQ(launches[0].entries[0].tensor, 1u);
  EXPECT_EQ(launches[0].entries[1].tensor, 4u);
  EXPECT_EQ(launches[0].blocks, 2u);
  EXPECT_TRUE(plan_chunk_launches({0, 0}, kChunkElems, 64, kMaxBlocksPerLaunch).empty());
  EXPECT_TRUE(plan_chunk_launches({}, kChunkElems, 64, kMaxBlocksPerLaunch).empty());
}

TEST(MultiTensorChunks, FullTableStartsANewLaunch) {
  const std::vector<int64_t> numels(7, 100);
  const auto launches = plan_chunk_launches(numels, 64, 3, kMaxBlocksPerLaunch);
  ASSERT_EQ(launches.size(), 3u);
  EXPECT_EQ(launches[0].entries.size(), 3u);
  EXPECT_EQ(launches[1].entries.size(), 3u);
  EXPECT_EQ(launches[2].entries.size(), 1u);
  EXPECT_EQ(launches[1].entries[0].tensor, 3u);
  EXPECT_EQ(launches[1].entries[0].first_block, 0u);
  EXPECT_EQ(launches[2].blocks, 2u);
  EXPECT_EQ(covered(launches, numels.size(), 64), numels);
}

TEST(MultiTensorChunks, BlockLimitSplitsATensorAcrossLaunches) {
  // 10 chunks of 16 (the last one partial) under a 4-block limit: 4 + 4 + 2 blocks.
  const std::vector<int64_t> numels = {3, 16 * 9 + 5};
  const auto launches = plan_chunk_launches(numels, 16, 8, 4);
  ASSERT_EQ(launches.size(), 3u);
  ASSERT_EQ(launches[0].entries.size(), 2u);
  EXPECT_EQ(launches[0].entries[1].begin, 0);
  EXPECT_EQ(launches[0].entries[1].end, 48);
  EXPECT_EQ(launches[1].entries[0].begin, 48);
  EXPECT_EQ(launches[1].entries[0].end, 112);
  EXPECT_EQ(launches[2].entries[0].begin, 112);
  EXPECT_EQ(launches[2].entries[0].end, 149);
  EXPECT_EQ(launches[2].blocks, 3u);
  EXPECT_EQ(covered(launches, numels.size(), 16), numels);
}

TEST(MultiTensorChunks, ManyTensorsOfMixedSizesAreCoveredExactlyOnce) {
  std::vector<int64_t> numels;
  for (int64_t i = 0; i < 500; ++i) numels.push_back((i * 7919) % 1000 * (i % 5 == 0 ? 0 : 1) + (i % 3) * 4096);
  const auto launches = plan_chunk_launches(numels, 1024, 37, 50);
  for (const ChunkLaunch& launch : launches) {
    EXPECT_LE(launch.entries.size(), 37u);
    EXPECT_LE(launch.blocks, 50u);
  }
  EXPECT_EQ(covered(launches, numels.size(), 1024), numels);
}

TEST(MultiTensorChunks, ElementCountsBeyond32Bits) {
  const int64_t big = (int64_t{1} << 33) + 3;
  const auto launches = plan_chunk_launches({big}, kChunkElems, 8, kMaxBlocksPerLaunch);
  ASSERT_EQ(launches.size(), 1u);
  EXPECT_EQ(launches[0].blocks, static_cast<uint32_t>((int64_t{1} << 17) + 1));
  EXPECT_EQ(launches[0].entries[0].end, big);
}

TEST(MultiTensorChunks, RejectsBadArguments) {
  EXPECT_THROW(plan_chunk_launches({-1}, 16, 8, 8), std::invalid_argument);
  EXPECT_THROW(plan_chunk_launches({1}, 0, 8, 8), std::invalid_argument);
  EXPECT_THROW(plan_chunk_launches({1}, 16, 0, 8), std::invalid_argument);
}

TEST(MultiTensorChunks, LocateEntry) {
  const std::vector<uint32_t> first = {0, 1, 4, 5, 9};
  const std::vector<int> owner = {0, 1, 1, 1, 2, 3, 3, 3, 3, 4, 4, 4};
  for (uint32_t b = 0; b < owner.size(); ++b) {
    EXPECT_EQ(locate_entry(first.data(), static_cast<int>(first.size()), b), owner[b]) << "block " << b;
  }
  const uint32_t single = 0;
  EXPECT_EQ(locate_entry(&single, 1, 7), 0);
}

TEST(MultiTensorChunks, VectorHeadFindsTheFirstAlignedElement) {
  alignas(16) static float storage[64];
  alignas(16) static uint16_t halves[64];
  const std::vector<std::size_t> f32x2{4, 4};
  EXPECT_EQ(vector_head({storage, storage + 4}, f32x2, 4), 0);      // both aligned
  EXPECT_EQ(vector_head({storage + 1, storage + 5}, f32x2, 4), 3);  // both 4 bytes in: 3 scalar elements
  EXPECT_EQ(vector_head({storage, storage + 1}, f32x2, 4), kScalarOnly);  // misaligned by different amounts
  const void* odd = reinterpret_cast<const char*>(storage) + 2;
  EXPECT_EQ(vector_head({odd}, {4}, 4), kScalarOnly);  // no whole element lands on a 16-byte boundary
  // Mixed sizes: bf16 gradients 6 elements (12 bytes) in, fp32 buffers 6 elements (24 bytes) in:
  // after 2 more elements both are aligned (16 and 32 bytes).
  EXPECT_EQ(vector_head({halves + 6, storage + 6}, {2, 4}, 8), 2);
  EXPECT_EQ(vector_head({}, {}, 4), 0);
  EXPECT_THROW(vector_head({storage}, {4, 4}, 4), std::invalid_argument);
  // Chunk starts keep alignment for 2- and 4-byte elements.
  EXPECT_EQ(kChunkElems * 2 % static_cast<int64_t>(kVectorBytes), 0);
}

// The kernel's split of a chunk: scalar head, 16-byte vectors, scalar tail. Every element is
// covered once and every vector starts on a 16-byte boundary, for any offset of a stack slice.
TEST(MultiTensorChunks, ChunkVectorRangeCoversEveryElementOnce) {
  alignas(16) static float base[4 * 256];
  constexpr int kVec = 4;
  for (int offset = 0; offset < 8; ++offset) {
    for (int64_t numel : {0, 1, 3, 4, 5, 17, 255, 256}) {
      const float* data = base + offset;
      const uint8_t head = vector_head({data}, {4}, kVec);
      ASSERT_NE(head, kScalarOnly);
      for (int64_t chunk : {int64_t{16}, int64_t{64}}) {
        std::vector<int> hits(static_cast<std::size_t>(numel), 0);
        for (int64_t begin = 0; begin < numel; begin += chunk) {
          const int64_t end = std::min(numel, begin + chunk);
          const VectorRange r = chunk_vector_range(begin, end, head, kVec);
          ASSERT_LE(begin, r.vector_begin);
          ASSERT_LE(r.vector_begin, r.vector_end);
          ASSERT_LE(r.vector_end, end);
          for (int64_t i = begin; i < r.vector_begin; ++i) ++hits[i];
          for (int64_t i = r.vector_begin; i < r.vector_end; i += kVec) {
            EXPECT_EQ(reinterpret_cast<std::uintptr_t>(data + i) % kVectorBytes, 0u);
            for (int k = 0; k < kVec; ++k) ++hits[i + k];
          }
          for (int64_t i = r.vector_end; i < end; ++i) ++hits[i];
        }
        for (int64_t i = 0; i < numel; ++i) ASSERT_EQ(hits[i], 1) << "offset " << offset << " element " << i;
      }
    }
  }
  const VectorRange scalar = chunk_vector_range(0, 10, kScalarOnly, 4);
  EXPECT_EQ(scalar.vector_begin, 10);
  EXPECT_EQ(scalar.vector_end, 10);
}

TEST(MultiTensorChunks, TableFitsTheKernelArgumentLimit) {
  EXPECT_LE(sizeof(TensorTable<1>) + kFunctorArgBytes, kKernelArgBytes);
  EXPECT_LE(sizeof(TensorTable<2>) + kFunctorArgBytes, kKernelArgBytes);
  EXPECT_LE(sizeof(TensorTable<3>) + kFunctorArgBytes, kKernelArgBytes);
  EXPECT_LE(sizeof(TensorTable<4>) + kFunctorArgBytes, kKernelArgBytes);
  EXPECT_LE(sizeof(TensorTable<6>) + kFunctorArgBytes, kKernelArgBytes);
  EXPECT_GE(TensorTable<4>::kCapacity, 60);
  EXPECT_GT(TensorTable<2>::kCapacity, TensorTable<4>::kCapacity);
}

TEST(MultiTensorChunks, MakeTensorTable) {
  std::vector<std::vector<void*>> pointers;
  std::vector<float> scales;
  std::vector<uint8_t> heads;
  static float data[8];
  for (int t = 0; t < 5; ++t) {
    pointers.push_back({data + t, data + t + 1});
    scales.push_back(0.5f * t);
    heads.push_back(t % 2 == 0 ? static_cast<uint8_t>(t) : kScalarOnly);
  }
  const auto launches = plan_chunk_launches({10, 0, 40, 5, 33}, 16, 2, 100);
  ASSERT_EQ(launches.size(), 2u);
  const TensorTable<2> table = make_tensor_table<2>(launches[1], pointers, scales, heads);
  ASSERT_EQ(table.count, 2);
  EXPECT_EQ(table.ptr[0][0], data + 3);
  EXPECT_EQ(table.ptr[1][1], data + 5);
  EXPECT_EQ(table.end[1], 33);
  EXPECT_EQ(table.first_block[1], 1u);
  EXPECT_FLOAT_EQ(table.scale[0], 1.5f);
  EXPECT_EQ(table.head[0], kScalarOnly);
  EXPECT_EQ(table.head[1], 4);
  const TensorTable<2> unscaled = make_tensor_table<2>(launches[0], pointers, {}, heads);
  EXPECT_FLOAT_EQ(unscaled.scale[1], 1.f);

  ChunkLaunch too_big;
  too_big.entries.resize(TensorTable<2>::kCapacity + 1);
  EXPECT_THROW(make_tensor_table<2>(too_big, pointers, scales, heads), std::invalid_argument);
}
