// Operand alignment of a strided-batched GEMM, as the cuBLASLt plan cache keys it. Torch-free and
// CUDA-free so the rules are unit-tested on the host.
//
// A plan (descriptors + algorithm) is chosen for a problem and the alignments its operands
// guarantee: the heuristic is told the minimum alignment of A, B, C and D, and only offers
// algorithms that work at that alignment. Such a plan therefore serves every later call of the
// same problem whose operands are at least as aligned, which lets a CUDA-graph capture reuse a plan
// chosen during a warm-up on differently placed (less aligned) tensors.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace megatron_eopt {

// Alignment in bytes of A, B, C and D.
using GemmAlignments = std::array<uint32_t, 4>;

// Largest power of two, at most 256, dividing the address and the batch stride in bytes: every
// matrix of the batch starts at least that aligned (cuBLASLt's default assumes 256 bytes).
inline uint32_t gemm_alignment(uintptr_t address, int64_t stride_elems, std::size_t elem_bytes) {
  const uint64_t bits = static_cast<uint64_t>(address) | static_cast<uint64_t>(stride_elems) * elem_bytes | 256u;
  return static_cast<uint32_t>(bits & (~bits + 1));
}

// Whether a plan chosen for `planned` alignments may run operands with `actual` alignments.
inline bool alignment_serves(const GemmAlignments& planned, const GemmAlignments& actual) {
  for (std::size_t i = 0; i < planned.size(); ++i) {
    if (planned[i] > actual[i]) return false;
  }
  return true;
}

// Among the alignments a problem was planned for, [first, last), one that serves `actual` (the
// last such in iteration order), or `last` when none does.
template <typename It, typename AlignmentsOf>
It find_serving_plan(It first, It last, const GemmAlignments& actual, AlignmentsOf alignments_of) {
  It found = last;
  for (It it = first; it != last; ++it) {
    if (alignment_serves(alignments_of(*it), actual)) found = it;
  }
  return found;
}

}  // namespace megatron_eopt
