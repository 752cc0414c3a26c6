// Temporaries of the CPU Newton–Schulz, kept between calls on each thread.
//
// A fresh multi-megabyte buffer per call costs one page fault (and a page cleared) per 4 KiB each
// time glibc has handed the memory back to the OS since the last call, which it does often: large
// chunks are mapped and unmapped whole, and the heap's free top is trimmed (a quarter of a
// bf16 Newton–Schulz call's time when measured; benchmarks/RESULTS.md). The pool keeps the buffers of finished calls for the next (up to kMaxPooledBytes per thread and
// kMaxPooledBytesPerProcess across threads; see cpu/scratch_budget.h).
#pragma once

#include <vector>

#include "cpu/scratch_budget.h"
#include "ops/stable.h"

namespace megatron_eopt {

// Lends contiguous CPU tensors from the calling thread's pool for the lifetime of the scratch
// (one Newton–Schulz call), then gives their storage back to the pool. Tensors taken must not
// outlive it: a later call on the thread reuses the storage.
class CpuScratch {
 public:
  CpuScratch() = default;
  ~CpuScratch();
  CpuScratch(const CpuScratch&) = delete;
  CpuScratch& operator=(const CpuScratch&) = delete;

  // An uninitialized contiguous tensor of `sizes`, fp32 or bf16, from the smallest pooled buffer
  // of that dtype that holds it (or a new one: the caps never refuse a buffer).
  Tensor take(const std::vector<int64_t>& sizes, ScalarType dtype);

  // Several such tensors, one per entry of `sizes`, from one pooled buffer, each starting on a
  // 64-byte boundary. A call that takes all its temporaries at once keeps one buffer in the pool,
  // which serves any later call no larger (see drop_smaller in cpu/scratch_budget.h).
  std::vector<Tensor> take_all(const std::vector<std::vector<int64_t>>& sizes, ScalarType dtype);

 private:
  std::vector<Tensor> lent_;  // flat buffers backing what was taken
};

}  // namespace megatron_eopt
