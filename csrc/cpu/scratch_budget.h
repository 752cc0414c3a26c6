// What the CPU scratch pools keep between calls (torch-free, so the policy is unit-tested alone).
//
// Each thread keeps the buffers of its finished calls for the next call on that thread, up to a
// per-thread cap (the temporaries of one large Newton–Schulz call). A process whose many threads
// all ran such calls would keep that much per thread (256 MiB each: 16 GiB on 64 threads), so the
// total kept across threads has a per-process cap as well. Either cap only decides what is kept
// for reuse after a call: a call always gets its buffers, and a buffer over a cap is freed.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace megatron_eopt {

// Bytes one thread keeps for later calls; beyond it the oldest are freed.
constexpr int64_t kMaxPooledBytes = int64_t{256} << 20;

// Bytes all threads together keep for later calls: four threads' worth. A few threads running the
// largest calls at once keep their reuse (the OpenMP / intra-op pool of a small host, or one
// thread per device); a many-core process does not grow its idle memory with the core count.
constexpr int64_t kMaxPooledBytesPerProcess = 4 * kMaxPooledBytes;

// The bytes kept across threads against a cap, shared by all threads (atomic; no lock).
class KeptBytesBudget {
 public:
  explicit constexpr KeptBytesBudget(int64_t cap) noexcept : cap_(cap) {}
  KeptBytesBudget(const KeptBytesBudget&) = delete;
  KeptBytesBudget& operator=(const KeptBytesBudget&) = delete;

  // Claims `bytes` for keeping: true and counted, or false and nothing changed when the total
  // would pass the cap.
  bool try_claim(int64_t bytes) noexcept {
    int64_t kept = kept_.load(std::memory_order_relaxed);
    do {
      if (bytes > cap_ - kept) return false;
    } while (!kept_.compare_exchange_weak(kept, kept + bytes, std::memory_order_relaxed));
    return true;
  }

  // Returns bytes claimed earlier (a kept buffer taken by a call, freed, or its thread ended).
  void release(int64_t bytes) noexcept { kept_.fetch_sub(bytes, std::memory_order_relaxed); }

  int64_t kept() const noexcept { return kept_.load(std::memory_order_relaxed); }
  int64_t cap() const noexcept { return cap_; }

 private:
  const int64_t cap_;
  std::atomic<int64_t> kept_{0};
};

// One thread's kept buffers, oldest first, and their bytes (claimed from `budget`).
template <class Buffer>
struct KeptBuffers {
  std::vector<Buffer> buffers;
  int64_t bytes = 0;
};

// Frees the oldest kept buffer (its bytes go back to `budget`).
template <class Buffer, class BytesOf>
void drop_oldest(KeptBuffers<Buffer>& kept, KeptBytesBudget& budget, BytesOf bytes_of) {
  const int64_t b = bytes_of(kept.buffers.front());
  kept.buffers.erase(kept.buffers.begin());
  kept.bytes -= b;
  budget.release(b);
}

// Keeps `returned` (a finished call's buffers) in the thread's `kept`, newest last: at most
// `thread_cap` bytes on the thread and the process's total within `budget`, freeing the thread's
// oldest buffers to make room for a newer one. A buffer that does not fit either way is freed.
// `returned` is left empty.
template <class Buffer, class BytesOf>
void keep_returned(KeptBuffers<Buffer>& kept, std::vector<Buffer>& returned, int64_t thread_cap,
                   KeptBytesBudget& budget, BytesOf bytes_of) {
  for (Buffer& buffer : returned) {
    const int64_t b = bytes_of(buffer);
    if (b > thread_cap || b > budget.cap()) continue;  // never kept: freed with `returned`
    while (kept.bytes + b > thread_cap) drop_oldest(kept, budget, bytes_of);
    bool claimed = budget.try_claim(b);
    while (!claimed && !kept.buffers.empty()) {  // other threads hold the rest: make room here
      drop_oldest(kept, budget, bytes_of);
      claimed = budget.try_claim(b);
    }
    if (claimed) {
      kept.bytes += b;
      kept.buffers.push_back(std::move(buffer));
    }
  }
  returned.clear();
}

// A call asks for `bytes` of a kind (dtype) that no kept buffer of that kind holds: the kept buffers
// of that kind smaller than the request are freed before the new one is allocated. Once the new
// buffer is kept it serves every call they could serve (each call takes the smallest kept buffer
// that holds it), so keeping them would only add their bytes to the process's resident memory
// while the call runs, and keep them there after. Nothing is freed for a request over a cap
// (`thread_cap`, the process's): that buffer is freed after its call, and the smaller calls would
// then page-fault fresh buffers every time.
template <class Buffer, class BytesOf, class SameKind>
void drop_smaller(KeptBuffers<Buffer>& kept, int64_t bytes, int64_t thread_cap, KeptBytesBudget& budget,
                  BytesOf bytes_of, SameKind same_kind) {
  if (bytes > thread_cap || bytes > budget.cap()) return;
  std::vector<Buffer> remaining;
  for (Buffer& buffer : kept.buffers) {
    const int64_t b = bytes_of(buffer);
    if (same_kind(buffer) && b < bytes) {
      kept.bytes -= b;
      budget.release(b);
    } else {
      remaining.push_back(std::move(buffer));
    }
  }
  kept.buffers = std::move(remaining);
}

// Takes the kept buffer at `index` out for a call (its bytes go back to `budget`).
template <class Buffer, class BytesOf>
Buffer take_kept(KeptBuffers<Buffer>& kept, std::size_t index, KeptBytesBudget& budget, BytesOf bytes_of) {
  Buffer buffer = std::move(kept.buffers[index]);
  kept.buffers.erase(kept.buffers.begin() + static_cast<std::ptrdiff_t>(index));
  const int64_t b = bytes_of(buffer);
  kept.bytes -= b;
  budget.release(b);
  return buffer;
}

}  // namespace megatron_eopt
