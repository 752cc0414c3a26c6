// Grouping of a list of tensors by shape, so each group runs as one batched launch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

namespace megatron_eopt {

// Returns, for each distinct shape in order of first appearance, the indices of the inputs that
// have it. Every input index appears exactly once.
inline std::vector<std::vector<std::size_t>> group_by_shape(const std::vector<std::vector<int64_t>>& shapes) {
  std::map<std::vector<int64_t>, std::size_t> slot;
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    auto it = slot.find(shapes[i]);
    if (it == slot.end()) {
      it = slot.emplace(shapes[i], groups.size()).first;
      groups.emplace_back();
    }
    groups[it->second].push_back(i);
  }
  return groups;
}

}  // namespace megatron_eopt
