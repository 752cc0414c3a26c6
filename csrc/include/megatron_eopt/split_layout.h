// Row layout of a fused projection split into parts (docs/design.md §4.8): rows = num_groups * sum(sizes),
// viewed as (num_groups, sum(sizes), n) and cut along the middle dimension; part k is the
// (num_groups * sizes[k], n) matrix of its rows across the groups. With Megatron's QKV layout the
// groups are the query groups and sizes = [q, kv, kv] (or [q, q, kv, kv] with an output gate);
// num_groups = 1 gives plain row splits (fused gate/up) or per-head splits.
// Torch-free, shared by the op and the GoogleTest suite.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace megatron_eopt {

struct SplitGroup {
  int64_t size;                    // rows per query group of each part in the group
  std::vector<std::size_t> parts;  // indices of the parts of that size, in order
};

struct SplitLayout {
  int64_t group_rows = 0;        // sum(sizes): rows of one query group
  std::vector<int64_t> offsets;  // per part: first row inside a query group
  std::vector<SplitGroup> same_size;  // parts grouped by size (order of first appearance): one NS batch each
};

// Validates the split of a (rows, n) matrix; std::invalid_argument names the argument at fault.
inline SplitLayout plan_split(int64_t rows, const std::vector<int64_t>& sizes, int64_t num_groups) {
  if (sizes.empty()) throw std::invalid_argument("split_sizes must not be empty");
  if (num_groups < 1) {
    throw std::invalid_argument("num_groups must be positive, got " + std::to_string(num_groups));
  }
  SplitLayout layout;
  std::map<int64_t, std::size_t> slot;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    if (sizes[k] < 1) {
      throw std::invalid_argument("split_sizes[" + std::to_string(k) + "] must be positive, got " +
                                  std::to_string(sizes[k]));
    }
    layout.offsets.push_back(layout.group_rows);
    layout.group_rows += sizes[k];
    auto it = slot.find(sizes[k]);
    if (it == slot.end()) {
      it = slot.emplace(sizes[k], layout.same_size.size()).first;
      layout.same_size.push_back({sizes[k], {}});
    }
    layout.same_size[it->second].parts.push_back(k);
  }
  if (rows % layout.group_rows != 0 || rows / layout.group_rows != num_groups) {
    throw std::invalid_argument("x has " + std::to_string(rows) +
                                " rows, which is not num_groups * sum(split_sizes) = " + std::to_string(num_groups) +
                                " * " + std::to_string(layout.group_rows));
  }
  return layout;
}

}  // namespace megatron_eopt
