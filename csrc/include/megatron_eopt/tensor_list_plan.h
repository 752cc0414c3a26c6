// Block planning of the per-list kernels (second-moment normalization): how many thread blocks
// each tensor of a list gets, where its per-block partial results live in a scratch array, and how
// the list is cut into launches whose tensor descriptors fit in the kernel arguments.
// Torch-free and CUDA-free, so it is unit-tested on any machine.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace megatron_eopt {

// Tensors per launch: the descriptors travel by value in the kernel arguments (no host-to-device
// copy, so launches are CUDA-graph safe), which keeps them under the portable 4 KiB limit.
constexpr std::size_t kMaxTensorsPerLaunch = 32;

struct TensorListPlan {
  std::vector<int64_t> blocks;       // per tensor; 0 for tensors without work
  std::vector<int64_t> first_block;  // per tensor: index of its first block over the whole list
  int64_t total_blocks = 0;          // = slots needed for one partial result per block
  // Launches in order; each holds the indices of tensors with work, at most
  // kMaxTensorsPerLaunch of them and fewer than 2^31 blocks in all.
  std::vector<std::vector<std::size_t>> launches;
};

// `work[i]` units of work for tensor i, `units_per_block` handled by a block per pass; a tensor
// gets ceil(work / units_per_block) blocks, capped at `max_blocks_per_tensor` (the blocks then
// loop over the rest).
inline TensorListPlan plan_tensor_list(const std::vector<int64_t>& work, int64_t units_per_block,
                                       int64_t max_blocks_per_tensor,
                                       std::size_t max_tensors_per_launch = kMaxTensorsPerLaunch) {
  if (units_per_block < 1 || max_blocks_per_tensor < 1 || max_tensors_per_launch < 1) {
    throw std::invalid_argument(
        "plan_tensor_list: units_per_block, max_blocks_per_tensor and "
        "max_tensors_per_launch must be positive");
  }
  constexpr int64_t kMaxBlocksPerLaunch = (int64_t{1} << 31) - 1;  // grid.x limit
  TensorListPlan plan;
  plan.blocks.resize(work.size(), 0);
  plan.first_block.resize(work.size(), 0);
  int64_t launch_blocks = 0;
  for (std::size_t i = 0; i < work.size(); ++i) {
    if (work[i] < 0) throw std::invalid_argument("plan_tensor_list: negative work");
    plan.first_block[i] = plan.total_blocks;
    if (work[i] == 0) continue;
    const int64_t wanted = work[i] / units_per_block + (work[i] % units_per_block != 0 ? 1 : 0);
    const int64_t blocks = std::min(wanted, max_blocks_per_tensor);
    plan.blocks[i] = blocks;
    plan.total_blocks += blocks;
    if (plan.launches.empty() || plan.launches.back().size() == max_tensors_per_launch ||
        launch_blocks > kMaxBlocksPerLaunch - blocks) {
      plan.launches.emplace_back();
      launch_blocks = 0;
    }
    plan.launches.back().push_back(i);
    launch_blocks += blocks;
  }
  return plan;
}

}  // namespace megatron_eopt
