// Where a Gram program's s x s values live (docs/design.md §4.4): in W storage while it is dead,
// else in as few dedicated s x s buffers as the program's liveness allows.
//
// A program (ns_gram_plan.h) names four s x s buffers (kS0..kS3) and kQx besides its W buffers
// (kX0, kX1 and the output kOut). Each W buffer holds nothing for part of the program: kX0 only
// from the first restart on when the input starts in kOut, kOut until the final product when W
// never lives there. An m x n buffer has room for l / s s x s matrices (s the Gram side, l the
// long one), so the products of those stretches need no memory of their own: on a 2048 x 8192
// matrix with quintic's five fp32 steps, the four 16 MiB s x s buffers become one.
//
// This header computes the liveness of every value (a buffer's contents from the op that writes
// it to its last read) and gives each s x s value a slot: a piece of a W buffer that holds no live
// W value and no other live s x s value over the whole of its life, or a dedicated buffer. The
// ops are unchanged, so the arithmetic is the same wherever the values live. Torch-free: a
// GoogleTest runs placed programs over one shared array.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "megatron_eopt/ns_gram_plan.h"

namespace megatron_eopt {

// The op index a value is written by or last read at: kBeforeOps for the normalized input (the
// executor's first pass writes it), ops.size() for the result (read by the caller).
constexpr int kBeforeOps = -1;

// One buffer's contents between the op that writes them and the last op that reads them.
struct GramValue {
  GramBuf buf;
  int first, last;
};

inline bool gram_is_square_buf(GramBuf b) {
  return b == GramBuf::kS0 || b == GramBuf::kS1 || b == GramBuf::kS2 || b == GramBuf::kS3 || b == GramBuf::kQx;
}

// What an op reads besides its operands a and b. kAddDiag updates d in place; a GEMM reads C only
// when beta != 0 (cuBLAS's contract, and the CPU executor's product with scalars reads R as a).
inline bool gram_op_reads_c(const GramOp& op) {
  return op.kind == GramOpKind::kGemm && op.beta != 0.f && op.c != GramBuf::kNone;
}

// Every value of `p` in the order written, and for each op the value each operand (a, b, c, d)
// refers to (-1: none). An op that updates d in place (kAddDiag, or a GEMM with c == d read)
// continues d's value.
struct GramLiveness {
  std::vector<GramValue> values;
  std::vector<std::array<int, 4>> operand_value;
};

inline GramLiveness gram_liveness(const GramProgram& p) {
  GramLiveness live;
  std::array<int, kGramBufCount> current;
  current.fill(-1);
  live.values.push_back({p.x_first, kBeforeOps, kBeforeOps});
  current[gram_buf_index(p.x_first)] = 0;
  const auto read = [&](GramBuf b, int at) {
    const int v = current[gram_buf_index(b)];
    if (v < 0) throw std::logic_error("gram program reads a buffer before writing it");
    live.values[static_cast<std::size_t>(v)].last = at;
    return v;
  };
  for (std::size_t i = 0; i < p.ops.size(); ++i) {
    const GramOp& op = p.ops[i];
    const int at = static_cast<int>(i);
    std::array<int, 4> refs = {-1, -1, -1, -1};
    if (op.a != GramBuf::kNone) refs[0] = read(op.a, at);
    if (op.b != GramBuf::kNone) refs[1] = read(op.b, at);
    if (gram_op_reads_c(op)) refs[2] = read(op.c, at);
    const bool in_place = op.kind == GramOpKind::kAddDiag || (gram_op_reads_c(op) && op.c == op.d);
    if (in_place) {
      refs[3] = read(op.d, at);
    } else {
      live.values.push_back({op.d, at, at});
      refs[3] = current[gram_buf_index(op.d)] = static_cast<int>(live.values.size() - 1);
    }
    live.operand_value.push_back(refs);
  }
  const int result = current[gram_buf_index(GramBuf::kOut)];
  if (result < 0) throw std::logic_error("gram program never writes its output");
  live.values[static_cast<std::size_t>(result)].last = static_cast<int>(p.ops.size());
  return live;
}

inline bool gram_lives_overlap(const GramValue& x, const GramValue& y) {
  return x.first <= y.last && y.first <= x.last;
}

// A home for s x s values: the `index`-th dedicated buffer (region kNone), or the `index`-th s x s
// piece of W buffer `region` (kX0, kX1 or kOut).
struct GramSlot {
  GramBuf region;
  int index;
};

struct GramPlacement {
  std::vector<GramSlot> slots;
  // Per op, the slot of each operand (a, b, c, d) that is an s x s buffer; -1 for W buffers and
  // unused operands.
  std::vector<std::array<int, 4>> operand_slot;
  int dedicated;  // dedicated s x s buffers the executor provides (slots with region kNone)
};

// pieces[b]: how many s x s values W buffer b (kX0, kX1, kOut) can hold at once in the executor's
// storage (0: none, e.g. a buffer the program does not use or a layout that cannot alias). Values
// are placed in the order written, each in the first slot that is free over its whole life: W
// pieces first, then dedicated buffers, adding one when none is free.
inline GramPlacement place_gram_values(const GramProgram& p, const std::array<int64_t, kGramBufCount>& pieces) {
  const GramLiveness live = gram_liveness(p);
  GramPlacement placement{};
  std::vector<int> slot_of_value(live.values.size(), -1);
  std::vector<std::vector<int>> values_in_slot;  // by slot: the s x s values placed there
  const auto slot_free = [&](int slot, const GramValue& v) {
    for (int other : values_in_slot[static_cast<std::size_t>(slot)]) {
      if (gram_lives_overlap(live.values[static_cast<std::size_t>(other)], v)) return false;
    }
    return true;
  };
  const auto region_free = [&](GramBuf region, const GramValue& v) {
    for (const GramValue& w : live.values) {
      if (w.buf == region && gram_lives_overlap(w, v)) return false;
    }
    return true;
  };
  // The slot of (region, index), or -1 while no value has been placed there.
  const auto find_slot = [&](GramBuf region, int index) {
    for (std::size_t s = 0; s < placement.slots.size(); ++s) {
      if (placement.slots[s].region == region && placement.slots[s].index == index) return static_cast<int>(s);
    }
    return -1;
  };
  // (region, index) when it is free over `value`'s life: its slot, made on first use.
  const auto take_if_free = [&](GramBuf region, int index, const GramValue& value) {
    int slot = find_slot(region, index);
    if (slot >= 0) return slot_free(slot, value) ? slot : -1;
    placement.slots.push_back({region, index});
    values_in_slot.emplace_back();
    slot = static_cast<int>(placement.slots.size() - 1);
    if (region == GramBuf::kNone) placement.dedicated = std::max(placement.dedicated, index + 1);
    return slot;
  };
  for (std::size_t v = 0; v < live.values.size(); ++v) {
    const GramValue& value = live.values[v];
    if (!gram_is_square_buf(value.buf)) continue;
    int chosen = -1;
    for (GramBuf region : {GramBuf::kX0, GramBuf::kX1, GramBuf::kOut}) {
      if (chosen >= 0 || !region_free(region, value)) continue;
      for (int64_t j = 0; j < pieces[gram_buf_index(region)] && chosen < 0; ++j) {
        chosen = take_if_free(region, static_cast<int>(j), value);
      }
    }
    for (int j = 0; chosen < 0; ++j) chosen = take_if_free(GramBuf::kNone, j, value);
    slot_of_value[v] = chosen;
    values_in_slot[static_cast<std::size_t>(chosen)].push_back(static_cast<int>(v));
  }
  for (const std::array<int, 4>& refs : live.operand_value) {
    std::array<int, 4> slots = {-1, -1, -1, -1};
    for (std::size_t k = 0; k < 4; ++k) {
      if (refs[k] >= 0) slots[k] = slot_of_value[static_cast<std::size_t>(refs[k])];
    }
    placement.operand_slot.push_back(slots);
  }
  return placement;
}

// How many pieces of `piece_elems` elements, each starting `piece_stride` elements after the last
// (the piece rounded up for alignment), fit in a buffer of `buffer_elems` elements.
inline int64_t gram_pieces_in(int64_t buffer_elems, int64_t piece_elems, int64_t piece_stride) {
  if (piece_elems <= 0 || piece_stride < piece_elems || buffer_elems < piece_elems) return 0;
  return (buffer_elems - piece_elems) / piece_stride + 1;
}

}  // namespace megatron_eopt
