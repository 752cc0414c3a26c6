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

inline int64_t chunk_count(int64_t numel, int64_t chunk_elems) { return (numel + chunk_elems - 1) / chunk_elems; }

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

// No element offset makes every pointer of the tensor 16-byte aligned: scalar loop only.
constexpr uint8_t kScalarOnly = 0xFF;

// The vector head of a tensor: the first element index h < vec at which every list's pointer
// (address[d], elements of elem_bytes[d]) is 16-byte aligned, so elements [h, h + k * vec) go in
// 16-byte vectors and only the h elements before (and a tail) are scalar. `vec` is the vector step
// of the narrowest type (16 / its size), so a step of vec elements keeps every list aligned, and
// chunk starts (multiples of kChunkElems) keep the same head. kScalarOnly when no h works, e.g. an
// fp32 slice at an odd byte offset, or lists misaligned by different element counts.
inline uint8_t vector_head(const std::vector<const void*>& addresses, const std::vector<std::size_t>& elem_bytes,
                           int vec) {
  if (addresses.size() != elem_bytes.size() || vec <= 0 || vec >= kScalarOnly) {
    throw std::invalid_argument("vector_head: one element size per address and 0 < vec < 255 required");
  }
  for (int h = 0; h < vec; ++h) {
    bool aligned = true;
    for (std::size_t d = 0; d < addresses.size() && aligned; ++d) {
      const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(addresses[d]) + h * elem_bytes[d];
      aligned = a % kVectorBytes == 0;
    }
    if (aligned) return static_cast<uint8_t>(h);
  }
  return kScalarOnly;
}

// The vector range [vector_begin, vector_end) of a chunk [begin, end) whose tensor has vector
// head `head` (kScalarOnly: empty range at `end`); the elements before and after it are scalar.
// Chunk starts are multiples of kChunkElems (a multiple of vec), so the head is the same in every
// chunk of a tensor.
struct VectorRange {
  int64_t vector_begin;
  int64_t vector_end;
};

MEGATRON_EOPT_HD VectorRange chunk_vector_range(int64_t begin, int64_t end, uint8_t head, int vec) {
  if (head == kScalarOnly) return {end, end};
  const int64_t first = begin + head < end ? begin + head : end;
  return {first, first + (end - first) / vec * vec};
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
  const std::size_t per_entry = depth * sizeof(void*) + 2 * sizeof(int64_t) + sizeof(uint32_t) + sizeof(float) +
                                1;  // + head
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
  uint8_t head[kCapacity];  // vector_head of the tensor (kScalarOnly: no vector loop)
  int32_t count;
};

// Fills the table of one planned launch. `pointers[t][d]` is list d's pointer of tensor t,
// `scales` (empty = all 1) a per-tensor scalar, `heads[t]` the tensor's vector_head.
template <int Depth>
TensorTable<Depth> make_tensor_table(const ChunkLaunch& launch, const std::vector<std::vector<void*>>& pointers,
                                     const std::vector<float>& scales, const std::vector<uint8_t>& heads) {
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
    table.head[e] = heads[entry.tensor];
  }
  return table;
}

}  // namespace megatron_eopt
