// The generic multi-tensor launcher of the foreach ops (CUDA, torch-free).
//
// An op is a functor with
//   static constexpr int kDepth;   // lists it touches (pointers per tensor)
//   static constexpr int kVec;     // elements per vector step: 16 bytes of its narrowest type
//   static constexpr std::size_t kElemBytes[];  // element size of each list (at least kDepth entries)
//   Context prepare() const;       // per-thread prologue (e.g. read lr from device memory); its
//                                  // `bool skip` (GradScaler's found_inf) makes the block write nothing
//   template <int V> void apply(const Context&, void* const (&ptrs)[kDepth], float scale, int64_t i) const;
//                                  // elements [i, i + V); V == kVec: 16-byte aligned vectors
// multi_tensor_apply plans the chunks (multi_tensor_chunks.h), passes each launch's table in the
// kernel arguments and runs one block per chunk: a scalar head up to the first element where every
// pointer of the tensor is 16-byte aligned (vector_head), the vector loop, a scalar tail; a scalar
// loop when no such element exists.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <iterator>
#include <vector>

#include "megatron_eopt/cuda_check.h"
#include "megatron_eopt/multi_tensor_chunks.h"
#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

constexpr int kMultiTensorThreads = 512;

// Loads V elements of T at p[i] as fp32; V > 1 reads whole 16-byte vectors (p + i aligned).
template <typename T, int V>
__device__ __forceinline__ void load_elements(const void* p, int64_t i, float (&out)[V]) {
  const T* base = static_cast<const T*>(p) + i;
  if constexpr (V == 1) {
    out[0] = to_float(base[0]);
  } else {
    static_assert(V * sizeof(T) % kVectorBytes == 0, "vector step must be whole 16-byte vectors");
    constexpr int kPieces = V * sizeof(T) / kVectorBytes;
    uint4 raw[kPieces];
#pragma unroll
    for (int k = 0; k < kPieces; ++k) raw[k] = reinterpret_cast<const uint4*>(base)[k];
    const T* vals = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = to_float(vals[k]);
  }
}

// Stores V fp32 values as T at p[i]; V > 1 writes whole 16-byte vectors.
template <typename T, int V>
__device__ __forceinline__ void store_elements(void* p, int64_t i, const float (&in)[V]) {
  T* base = static_cast<T*>(p) + i;
  if constexpr (V == 1) {
    base[0] = from_float<T>(in[0]);
  } else {
    constexpr int kPieces = V * sizeof(T) / kVectorBytes;
    uint4 raw[kPieces];
    T* vals = reinterpret_cast<T*>(raw);
#pragma unroll
    for (int k = 0; k < V; ++k) vals[k] = from_float<T>(in[k]);
#pragma unroll
    for (int k = 0; k < kPieces; ++k) reinterpret_cast<uint4*>(base)[k] = raw[k];
  }
}

template <int Depth, typename Op>
__global__ void __launch_bounds__(kMultiTensorThreads)
    multi_tensor_kernel(const __grid_constant__ TensorTable<Depth> table, const Op op) {
  const int t = locate_entry(table.first_block, table.count, blockIdx.x);
  const int64_t begin = table.begin[t] + static_cast<int64_t>(blockIdx.x - table.first_block[t]) * kChunkElems;
  const int64_t end = begin + kChunkElems < table.end[t] ? begin + kChunkElems : table.end[t];
  void* ptrs[Depth];
#pragma unroll
  for (int d = 0; d < Depth; ++d) ptrs[d] = table.ptr[d][t];
  const float scale = table.scale[t];
  const auto ctx = op.prepare();
  if (ctx.skip) return;  // the same for every block: nothing of the step is written

  constexpr int V = Op::kVec;
  const VectorRange range = chunk_vector_range(begin, end, table.head[t], V);
  const int64_t vector_begin = range.vector_begin;
  const int64_t vector_end = range.vector_end;
  for (int64_t i = vector_begin + static_cast<int64_t>(threadIdx.x) * V; i < vector_end;
       i += static_cast<int64_t>(blockDim.x) * V) {
    op.template apply<V>(ctx, ptrs, scale, i);
  }
  // Scalar head [begin, vector_begin) and tail [vector_end, end).
  const int64_t head_count = vector_begin - begin;
  const int64_t scalar_count = head_count + (end - vector_end);
  for (int64_t k = threadIdx.x; k < scalar_count; k += blockDim.x) {
    op.template apply<1>(ctx, ptrs, scale, k < head_count ? begin + k : vector_end + (k - head_count));
  }
}

// Runs `op` over tensors t with list pointers pointers[t][0..Depth), numels[t] elements and the
// per-tensor scalar scales[t] (empty: 1). Enqueues on `stream`; no host synchronisation.
template <typename Op>
void multi_tensor_apply(const std::vector<std::vector<void*>>& pointers, const std::vector<int64_t>& numels,
                        const std::vector<float>& scales, const Op& op, cudaStream_t stream) {
  constexpr int Depth = Op::kDepth;
  static_assert(sizeof(TensorTable<Depth>) + sizeof(Op) <= kKernelArgBytes, "kernel arguments exceed the 4 KiB limit");
  static_assert(sizeof(Op) <= kFunctorArgBytes, "functor larger than its kernel-argument budget");
  static_assert(std::size(Op::kElemBytes) >= Depth, "one element size per list");
  const std::vector<std::size_t> elem_bytes(std::begin(Op::kElemBytes), std::begin(Op::kElemBytes) + Depth);
  std::vector<uint8_t> heads(pointers.size());
  for (std::size_t t = 0; t < pointers.size(); ++t) {
    heads[t] = vector_head(std::vector<const void*>(pointers[t].begin(), pointers[t].end()), elem_bytes, Op::kVec);
  }
  const std::vector<ChunkLaunch> launches = plan_chunk_launches(numels, kChunkElems, TensorTable<Depth>::kCapacity,
                                                                kMaxBlocksPerLaunch);
  for (const ChunkLaunch& launch : launches) {
    const TensorTable<Depth> table = make_tensor_table<Depth>(launch, pointers, scales, heads);
    multi_tensor_kernel<Depth, Op><<<launch.blocks, kMultiTensorThreads, 0, stream>>>(table, op);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace megatron_eopt
