// Host-side planning of multi-tensor launches (torch-free, CUDA-free; GoogleTest covers it).
//
// The tensors of a list are cut into chunks of kChunkElems elements; one CUDA block (or one CPU
// task) handles one chunk. A launch carries a table of entries in its kernel arguments: the
// pointers of every list for one tensor, the element range [begin, end) of that tensor covered by
// the launch, and the first block of the entry (blocks of a launch are numbered entry after entry,
// so a block finds its entry by binary search over `first_block`). When the table is full, or a
// launch reaches its block limit, planning continues in a new launch; a tensor can span launches.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

// 64K elements per chunk: big enough to amortize a block's start, small enough to spread one
// tensor over many SMs. A multiple of every vector width, so chunk starts keep pointer alignment.
constexpr int64_t kChunkElems = int64_t{1} << 16;
// Bytes of a vector access: pointers aligned to this take the vectorized path.
constexpr std::size_t kVectorBytes = 16;
// CUDA's classic kernel-argument limit; the table plus the op's own arguments stay below it.
constexpr std::size_t kKernelArgBytes = 4096;
// Room left in the kernel arguments for the op's functor (pointers to lr / weight decay, constants).
constexpr std::size_t kFunctorArgBytes = 128;
// Blocks of one launch (grid.x is limited to 2^31 - 1).
constexpr uint32_t kMaxBlocksPerLaunch = (uint32_t{1} << 31) - 1;

struct ChunkEntry {
  std::size_t tensor;    // index into the caller's lists
  int64_t begin;         // first element of the tensor covered by this entry (multiple of chunk)
  int64_t end;           // one past the last element
  uint32_t first_block;  // block of the launch that handles the chunk starting at `begin`
};

struct ChunkLaunch {
  std::vector<ChunkEntry> entries;
  uint32_t blocks = 0;  // total blocks of the launch
};

inline int64_t chunk_count(int64_t numel, int64_t chunk_elems) {
  return (numel + chunk_elems - 1) / chunk_elems;
}

// Splits tensors of `numels` elements (empty ones skipped) into launches of at most
// `max_entries` table entries and `max_blocks` blocks.
inline std::vector<ChunkLaunch> plan_chunk_launches(const std::vector<int64_t>& numels, int64_t chunk_elems,
                                                    std::size_t max_entries, uint32_t max_blocks) {
  if (chunk_elems <= 0 || max_entries == 0 || max_blocks == 0) {
    throw std::invalid_argument("plan_chunk_launches: chunk size, entries and blocks must be positive");
  }
  std::vector<ChunkLaunch> launches;
  ChunkLaunch current;
  for (std::size_t t = 0; t < numels.size(); ++t) {
    if (numels[t] < 0) throw std::invalid_argument("plan_chunk_launches: negative element count");
    int64_t next_chunk = 0;
    const int64_t chunks = chunk_count(numels[t], chunk_elems);
    while (next_chunk < chunks) {
      if (current.entries.size() == max_entries || current.blocks == max_blocks) {
        launches.push_back(std::move(current));
        current = ChunkLaunch{};
      }
      const int64_t take = std::min<int64_t>(chunks - next_chunk, max_blocks - current.blocks);
      const int64_t begin = next_chunk * chunk_elems;
      const int64_t end = std::min(numels[t], (next_chunk + take) * chunk_elems);
      current.entries.push_back(ChunkEntry{t, begin, end, current.blocks});
      current.blocks += static_cast<uint32_t>(take);
      next_chunk += take;
    }
  }
  if (!current.entries.empty()) launches.push_back(std::move(current));
  return launches;
}

// True when every address is aligned to kVectorBytes: then all lists of the tensor can be read
// and written with 16-byte vectors (chunk starts preserve the alignment, see kChunkElems).
inline bool vector_aligned(const std::vector<const void*>& addresses) {
  return std::all_of(addresses.begin(), addresses.end(), [](const void* a) {
    return reinterpret_cast<std::uintptr_t>(a) % kVectorBytes == 0;
  });
}

// Index of the entry that owns `block`: the last one whose first_block <= block.
MEGATRON_EOPT_HD int locate_entry(const uint32_t* first_block, int count, uint32_t block) {
  int lo = 0;
  int hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_block[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Entries a table of `depth` lists can hold within the kernel-argument budget.
constexpr int table_capacity(int depth) {
  // pointers + begin + end + first_block + scale + vectorized flag
  const std::size_t per_entry = depth * sizeof(void*) + 2 * sizeof(int64_t) + sizeof(uint32_t) + sizeof(float) + 1;
  return static_cast<int>((kKernelArgBytes - kFunctorArgBytes - 16) / per_entry);
}

// The kernel-argument table of one launch over `Depth` lists.
template <int Depth>
struct TensorTable {
  static constexpr int kCapacity = table_capacity(Depth);
  void* ptr[Depth][kCapacity];
  int64_t begin[kCapacity];
  int64_t end[kCapacity];
  uint32_t first_block[kCapacity];
  float scale[kCapacity];  // per-tensor scalar (the update's scales), 1 when unused
  uint8_t vectorized[kCapacity];
  int32_t count;
};

// Fills the table of one planned launch. `pointers[t][d]` is list d's pointer of tensor t,
// `scales` (empty = all 1) a per-tensor scalar, `aligned[t]` the vector_aligned decision.
template <int Depth>
TensorTable<Depth> make_tensor_table(const ChunkLaunch& launch, const std::vector<std::vector<void*>>& pointers,
                                     const std::vector<float>& scales, const std::vector<bool>& aligned) {
  if (launch.entries.size() > static_cast<std::size_t>(TensorTable<Depth>::kCapacity)) {
    throw std::invalid_argument("make_tensor_table: launch has more entries than the table holds");
  }
  TensorTable<Depth> table{};
  table.count = static_cast<int32_t>(launch.entries.size());
  for (std::size_t e = 0; e < launch.entries.size(); ++e) {
    const ChunkEntry& entry = launch.entries[e];
    for (int d = 0; d < Depth; ++d) table.ptr[d][e] = pointers[entry.tensor][d];
    table.begin[e] = entry.begin;
    table.end[e] = entry.end;
    table.first_block[e] = entry.first_block;
    table.scale[e] = scales.empty() ? 1.f : scales[entry.tensor];
    table.vectorized[e] = aligned[entry.tensor] ? 1 : 0;
  }
  return table;
}

}  // namespace megatron_eopt
