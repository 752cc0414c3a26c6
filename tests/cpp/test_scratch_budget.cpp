// The CPU scratch pools' keep policy: a per-thread cap and a per-process cap on the bytes kept
// between calls, the oldest freed first, nothing ever refused to a call.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "cpu/scratch_budget.h"

namespace megatron_eopt {
namespace {

// A buffer is its size in bytes here.
int64_t bytes_of(int64_t b) { return b; }

TEST(ScratchBudget, DefaultsBoundTheProcess) {
  EXPECT_EQ(kMaxPooledBytes, int64_t{256} << 20);
  EXPECT_EQ(kMaxPooledBytesPerProcess, int64_t{1} << 30);
}

TEST(ScratchBudget, ClaimsUpToTheCapAndNoFurther) {
  KeptBytesBudget budget(100);
  EXPECT_TRUE(budget.try_claim(60));
  EXPECT_FALSE(budget.try_claim(41));  // refused: nothing counted
  EXPECT_EQ(budget.kept(), 60);
  EXPECT_TRUE(budget.try_claim(40));
  EXPECT_EQ(budget.kept(), 100);
  budget.release(60);
  EXPECT_EQ(budget.kept(), 40);
}

TEST(ScratchBudget, ThreadCapFreesTheOldest) {
  KeptBytesBudget budget(1000);
  KeptBuffers<int64_t> kept;
  std::vector<int64_t> call{30, 40};
  keep_returned(kept, call, 100, budget, bytes_of);
  EXPECT_TRUE(call.empty());
  call = {50};
  keep_returned(kept, call, 100, budget, bytes_of);  // 30 + 40 + 50 > 100: the 30 goes
  EXPECT_EQ(kept.buffers, (std::vector<int64_t>{40, 50}));
  EXPECT_EQ(kept.bytes, 90);
  EXPECT_EQ(budget.kept(), 90);
  call = {150};  // over the thread's cap: freed, the kept ones stay
  keep_returned(kept, call, 100, budget, bytes_of);
  EXPECT_EQ(kept.buffers, (std::vector<int64_t>{40, 50}));
  EXPECT_EQ(budget.kept(), 90);
}

TEST(ScratchBudget, ProcessCapBindsAcrossThreads) {
  KeptBytesBudget budget(100);
  KeptBuffers<int64_t> first, second;
  std::vector<int64_t> call{70};
  keep_returned(first, call, 100, budget, bytes_of);
  call = {20, 20};
  keep_returned(second, call, 100, budget, bytes_of);  // 70 + 20 fits, the next 20 does not
  // the second thread frees its own oldest for the newer buffer; the first thread's stays
  EXPECT_EQ(second.buffers, (std::vector<int64_t>{20}));
  EXPECT_EQ(first.buffers, (std::vector<int64_t>{70}));
  EXPECT_EQ(budget.kept(), 90);
  call = {50};  // no room even with the thread's own freed: not kept
  keep_returned(second, call, 100, budget, bytes_of);
  EXPECT_TRUE(second.buffers.empty());
  EXPECT_EQ(second.bytes, 0);
  EXPECT_EQ(budget.kept(), 70);
  // a buffer taken for a call gives its bytes back
  int64_t taken = take_kept(first, 0, budget, bytes_of);
  EXPECT_EQ(taken, 70);
  EXPECT_EQ(budget.kept(), 0);
  EXPECT_EQ(first.bytes, 0);
}

TEST(ScratchBudget, AMissFreesTheSmallerBuffersOfItsKind) {
  // Odd sizes stand for bf16 buffers, even ones for fp32: only the request's kind is freed.
  const auto even = [](int64_t b) { return b % 2 == 0; };
  KeptBytesBudget budget(1000);
  KeptBuffers<int64_t> kept;
  std::vector<int64_t> call{40, 11, 80, 60, 101};
  keep_returned(kept, call, 1000, budget, bytes_of);
  drop_smaller(kept, 70, 1000, budget, bytes_of, even);  // 40 and 60 can only serve what 70 serves
  EXPECT_EQ(kept.buffers, (std::vector<int64_t>{11, 80, 101}));
  EXPECT_EQ(kept.bytes, 192);
  EXPECT_EQ(budget.kept(), 192);
  drop_smaller(kept, 80, 1000, budget, bytes_of, even);  // a buffer as large as the request stays
  EXPECT_EQ(kept.buffers, (std::vector<int64_t>{11, 80, 101}));
  // A request over the thread's cap (or the process's) will not be kept after its call: the
  // buffers it would replace stay for the calls after it.
  drop_smaller(kept, 501, 500, budget, bytes_of, [](int64_t b) { return b % 2 == 1; });
  EXPECT_EQ(kept.buffers, (std::vector<int64_t>{11, 80, 101}));
  KeptBytesBudget small(400);
  drop_smaller(kept, 401, 1000, small, bytes_of, [](int64_t b) { return b % 2 == 1; });
  EXPECT_EQ(kept.buffers, (std::vector<int64_t>{11, 80, 101}));
  drop_smaller(kept, 1000, 1000, budget, bytes_of, [](int64_t b) { return b % 2 == 1; });
  EXPECT_EQ(kept.buffers, (std::vector<int64_t>{80}));
  EXPECT_EQ(budget.kept(), 80);
}

TEST(ScratchBudget, ConcurrentThreadsNeverPassTheCapAndBalance) {
  constexpr int64_t kCap = 1000;
  KeptBytesBudget budget(kCap);
  std::atomic<int64_t> highest{0};
  std::atomic<int> done{0}, ended{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      KeptBuffers<int64_t> kept;
      for (int i = 0; i < 2000; ++i) {
        std::vector<int64_t> call{int64_t{10} + (i * 7 + t * 13) % 150, int64_t{5} + (i + t) % 40};
        keep_returned(kept, call, 300, budget, bytes_of);
        EXPECT_LE(kept.bytes, 300);
        int64_t now = budget.kept();
        int64_t seen = highest.load();
        while (now > seen && !highest.compare_exchange_weak(seen, now)) {
        }
        if (i % 3 == 0 && !kept.buffers.empty()) take_kept(kept, kept.buffers.size() / 2, budget, bytes_of);
      }
      // all threads hold what they kept at once (8 threads x 300 bytes would pass the cap)
      done.fetch_add(1);
      while (done.load() < 8) std::this_thread::yield();
      int64_t now = budget.kept();
      int64_t seen = highest.load();
      while (now > seen && !highest.compare_exchange_weak(seen, now)) {
      }
      ended.fetch_add(1);
      while (ended.load() < 8) std::this_thread::yield();
      while (!kept.buffers.empty()) drop_oldest(kept, budget, bytes_of);  // the thread ends
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_LE(highest.load(), kCap);
  EXPECT_GT(highest.load(), kCap / 2);
  EXPECT_EQ(budget.kept(), 0);
}

}  // namespace
}  // namespace megatron_eopt
