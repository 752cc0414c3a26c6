// Where the standard Newton–Schulz iteration on CUDA keeps its buffers (kernels/newton_schulz.cu):
// byte offsets inside one scratch allocation of the caching allocator, or inside the input's own
// storage when the call writes its result over its input; and the normalization's scratch, which
// the Gram iteration's layout (ns_gram_plan.h) places the same way. Also the CPU standard
// iteration's use of its output's storage under "medium" (ns_cpu_bf16_layout). Torch- and
// CUDA-free, so GoogleTest checks the layouts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_precision.h"

namespace megatron_eopt {

inline std::size_t ns_align256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// `elems` values of `elem_bytes` each, rounded up to whole 64-byte cache lines: where the CPU
// places one temporary after another inside a buffer (ATen's own CPU allocations are 64-byte
// aligned), so each starts as aligned as the buffer does.
inline int64_t ns_cpu_aligned_elems(int64_t elems, int64_t elem_bytes) {
  const int64_t line = 64 / elem_bytes;
  return (elems + line - 1) / line * line;
}

// Ends `layout` (a scratch layout of a call, either iteration's) with the normalization's scratch,
// placed from byte `offset` on: `batch` sums of squares, then `norm_partial_slots` partial sums;
// `total` is where it stops.
template <typename Layout>
Layout end_with_norm_scratch(Layout layout, std::size_t offset, int64_t batch, int64_t norm_partial_slots) {
  layout.sum_squares = offset;
  layout.norm_partials = offset + ns_align256(static_cast<std::size_t>(batch) * sizeof(float));
  layout.total = layout.norm_partials + ns_align256(static_cast<std::size_t>(norm_partial_slots) * sizeof(float));
  return layout;
}

// Bytes of one of G and B for a batch: batch matrices of g x padded_square_ld(g) elements of the
// compute type, g the Gram side (every matrix of the batch 16-byte aligned, make_ns_gemm_plan).
inline std::size_t ns_product_bytes(int64_t batch, int64_t m, int64_t n, bool transpose, NsPrecision precision) {
  const int64_t g = transpose ? n : m;
  return ns_align256(static_cast<std::size_t>(batch * padded_square_ld(g) * g) * ns_element_bytes(precision));
}

// Byte offsets, 256-byte aligned. iterate0 is SIZE_MAX when `out` serves as iterate[0] (fp32
// compute). With products_in_input, `gram` and `poly` are offsets into the input's storage
// instead of the scratch.
struct NsScratchLayout {
  std::size_t iterate0;
  std::size_t iterate1;
  std::size_t gram;
  std::size_t poly;
  bool products_in_input;
  std::size_t sum_squares;
  std::size_t norm_partials;
  std::size_t total;  // bytes of the scratch allocation
};

// Whether G and B may live in the input's storage (batch * m * n floats) of a call that writes its
// result over its input: under "medium" the iterates are bf16 scratch, so from the pass that
// normalizes the input into the first iterate until the pass that widens the last iterate into
// the output, nothing reads or writes the input's storage but the products. They must fit it at
// their aligned sizes (a square matrix's padded rows may not).
inline bool ns_products_fit_in_input(int64_t batch, int64_t m, int64_t n, bool transpose, NsPrecision precision) {
  if (precision != NsPrecision::kMedium) return false;  // fp32 iterates: the output is iterate[0]
  const std::size_t input_bytes = static_cast<std::size_t>(batch * m * n) * sizeof(float);
  return 2 * ns_product_bytes(batch, m, n, transpose, precision) <= input_bytes;
}

// The layout of one call: two iterates (one when fp32 compute writes `out` directly), G and B
// (in the input's storage when `result_over_input` and they fit), the per-matrix sums of squares
// and `norm_partial_slots` partial sums of the normalization.
inline NsScratchLayout ns_scratch_layout(int64_t batch, int64_t m, int64_t n, bool transpose, NsPrecision precision,
                                         int64_t norm_partial_slots, bool result_over_input = false) {
  const std::size_t iterate_bytes = ns_align256(static_cast<std::size_t>(batch * m * n) * ns_element_bytes(precision));
  const std::size_t product_bytes = ns_product_bytes(batch, m, n, transpose, precision);
  NsScratchLayout layout{};
  std::size_t offset = 0;
  if (precision == NsPrecision::kMedium) {
    layout.iterate0 = offset;
    offset += iterate_bytes;
  } else {
    layout.iterate0 = SIZE_MAX;
  }
  layout.iterate1 = offset;
  offset += iterate_bytes;
  layout.products_in_input = result_over_input && ns_products_fit_in_input(batch, m, n, transpose, precision);
  if (layout.products_in_input) {
    layout.gram = 0;
    layout.poly = product_bytes;
  } else {
    layout.gram = offset;
    offset += product_bytes;
    layout.poly = offset;
    offset += product_bytes;
  }
  return end_with_norm_scratch(layout, offset, batch, norm_partial_slots);
}

// The CPU standard iteration under "medium" (cpu/newton_schulz_standard_cpu.cpp) iterates in bf16
// and widens its result into the fp32 output at the end; until then the output's storage (room
// for 2 N bf16 values, N = batch * m * n) holds nothing, in place or not (the input is read only
// by the normalization, which writes the other iterate). Its first N bf16 values take one of the
// two iterates, and the rest G and P (batch * side * side each, unpadded) where they fit, each
// at a multiple of 64 bytes from the storage's start (ns_cpu_aligned_elems). Offsets in bf16
// values; -1: in scratch.
struct NsCpuBf16Layout {
  int64_t gram;
  int64_t poly;
};

inline NsCpuBf16Layout ns_cpu_bf16_layout(int64_t batch, int64_t m, int64_t n, int64_t side) {
  const int64_t iterate = batch * m * n, capacity = 2 * iterate, square = batch * side * side;
  NsCpuBf16Layout layout{-1, -1};
  int64_t at = ns_cpu_aligned_elems(iterate, 2);
  if (at + square > capacity) return layout;
  layout.gram = at;
  at = ns_cpu_aligned_elems(at + square, 2);
  if (at + square <= capacity) layout.poly = at;
  return layout;
}
}  // namespace megatron_eopt
