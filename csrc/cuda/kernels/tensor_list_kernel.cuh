// Device side of the per-list kernels: the launch argument that carries a batch of tensor
// descriptors by value, the lookup of a block's tensor, and block reductions.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "megatron_eopt/cuda_check.h"
#include "megatron_eopt/tensor_list_plan.h"

namespace megatron_eopt {

// Launch shape of the elementwise passes over a list (AdaMuon, NAMO's sums and scale, NorMuon's
// apply): 256 threads; a tensor gets one block per 8 elements a thread, up to 1024 blocks, whose
// threads then loop over the rest.
namespace elementwise {
constexpr int kThreads = 256;
constexpr int64_t kElementsPerBlock = kThreads * 8;
constexpr int64_t kMaxBlocksPerTensor = 1024;
}  // namespace elementwise

// Kernel argument of one launch: blocks [block_start[t], block_start[t + 1]) work on tensors[t].
template <typename Desc>
struct TensorListArgs {
  Desc tensors[kMaxTensorsPerLaunch];
  int32_t block_start[kMaxTensorsPerLaunch + 1];
  int32_t count;
};

// Which tensor this block serves, its rank among that tensor's blocks, and their number.
struct BlockSlot {
  int tensor;
  int64_t local;
  int64_t blocks;
};

template <typename Desc>
__device__ __forceinline__ BlockSlot block_slot(const TensorListArgs<Desc>& args) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  int lo = 0;
  int hi = args.count - 1;
  while (lo < hi) {  // last t with block_start[t] <= b (every listed tensor has at least one block)
    const int mid = (lo + hi + 1) / 2;
    if (args.block_start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return {lo, static_cast<int64_t>(b - args.block_start[lo]),
          static_cast<int64_t>(args.block_start[lo + 1] - args.block_start[lo])};
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum of (a, b) over the block, returned to every thread, in a fixed order (deterministic).
// blockDim.x must be a multiple of 32; every thread of the block must call it.
__device__ __forceinline__ float2 block_sum2(float a, float b) {
  __shared__ float2 warp_parts[32];
  __shared__ float2 total;
  a = warp_sum(a);
  b = warp_sum(b);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_parts[warp] = make_float2(a, b);
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    float2 p = lane < warps ? warp_parts[lane] : make_float2(0.f, 0.f);
    p.x = warp_sum(p.x);
    p.y = warp_sum(p.y);
    if (lane == 0) total = p;
  }
  __syncthreads();
  return total;
}

// Sum of v over the block, returned to every thread, in a fixed order (deterministic).
__device__ __forceinline__ float block_sum(float v) { return block_sum2(v, 0.f).x; }

// Sum of the per-block partial pairs [first, first + count) of a tensor, returned to every
// thread; every block reading them gets bit-identical sums.
__device__ __forceinline__ float2 sum_partials(const float2* __restrict__ partials, int64_t first, int64_t count) {
  float a = 0.f;
  float b = 0.f;
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    const float2 p = partials[first + j];
    a += p.x;
    b += p.y;
  }
  return block_sum2(a, b);
}

// Enqueues `kernel` once per launch of `plan`: fills the descriptors with make(i) for the list
// index i of each tensor in the launch.
template <typename Desc, typename Kernel, typename Make, typename... Extra>
void launch_tensor_list(const TensorListPlan& plan, int threads, cudaStream_t stream, Kernel kernel, Make make,
                        Extra... extra) {
  // Kernel arguments stay within the 4 KiB every architecture and toolkit accepts.
  static_assert(sizeof(TensorListArgs<Desc>) + (sizeof(Extra) + ... + 0) <= 4096,
                "tensor descriptors and extra arguments too large for kernel arguments");
  for (const std::vector<std::size_t>& members : plan.launches) {
    TensorListArgs<Desc> args{};
    int32_t blocks = 0;
    for (std::size_t t = 0; t < members.size(); ++t) {
      args.tensors[t] = make(members[t]);
      args.block_start[t] = blocks;
      blocks += static_cast<int32_t>(plan.blocks[members[t]]);
    }
    args.block_start[members.size()] = blocks;
    args.count = static_cast<int32_t>(members.size());
    kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(args, extra...);
    MEGATRON_EOPT_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace megatron_eopt
