// Memory-layout predicates of a strided tensor (sizes and strides in elements), as ATen defines
// them: the glue decides with them whether tensors of one index can be walked as flat arrays and
// whether a tensor may be written in place. Torch-free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace megatron_eopt {

// Every element has its own address and the elements fill one gap-free block (a permutation of
// the dims makes the tensor contiguous); size-1 dims may have any stride.
inline bool non_overlapping_and_dense(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  const std::size_t dims = sizes.size();
  std::vector<std::size_t> order(dims);
  std::iota(order.begin(), order.end(), std::size_t{0});
  // Innermost first; ties broken by the later dim, as a contiguous tensor orders them.
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return strides[a] != strides[b] ? strides[a] < strides[b] : a > b; });
  int64_t expected = 1;
  for (std::size_t d : order) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

// Two elements certainly share an address: a dim of more than one element has stride 0 (an
// expanded tensor). Like ATen's has_internal_overlap == Yes (other overlaps are not detected).
inline bool has_internal_overlap(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides) {
  if (non_overlapping_and_dense(sizes, strides)) return false;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && strides[d] == 0) return true;
  }
  return false;
}

}  // namespace megatron_eopt
