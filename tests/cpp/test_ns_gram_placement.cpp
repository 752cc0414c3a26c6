// Placement of a Gram program's s x s values (ns_gram_placement.h): each placed program is run
// over one shared array, W buffers and s x s pieces overlapping as the CPU executor lays them out,
// with NaN wherever nothing was written; it must give bit for bit what the same program gives
// with a buffer of its own per name. A value overwritten while live changes that result.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <random>
#include <vector>

#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_gram_placement.h"
#include "megatron_eopt/ns_gram_plan.h"
#include "reference_gram.h"

using namespace megatron_eopt;

namespace {

const std::vector<double> kQuintic = {4.0848, -6.8946, 2.9270,  3.9505, -6.3029, 2.6377,  3.7418, -5.5913,
                                      2.3037, 2.8769,  -3.1427, 1.2046, 2.8366,  -3.0525, 1.2012};
const std::vector<double> kPolar = {8.2051, -22.9019, 16.4607, 4.0664, -2.8612, 0.5184, 3.9096, -2.8234, 0.5250};

struct Case {
  int64_t batch, m, n;
  bool transpose;
  long steps;
  GramArithmetic arithmetic;
  bool polar;
  bool cpu = false;  // the CPU's program: bf16 W values in fp32 buffers, the output among them
};

GramProgram program_of(const Case& c) {
  const std::vector<double>& table = c.polar ? kPolar : kQuintic;
  const auto sched = expand_schedule(table, c.steps, c.polar ? SchedulePolicy::kRepeatLast : SchedulePolicy::kCycle);
  const bool bf16 = c.arithmetic == GramArithmetic::kBf16W;
  return make_gram_program(c.m, c.n, c.transpose, sched, gram_restarts(sched, c.arithmetic), bf16, !bf16 || c.cpu);
}

std::vector<double> normalized_input(const Case& c) {
  std::mt19937 rng(static_cast<unsigned>(c.m * 131 + c.n * 7 + c.batch));
  std::normal_distribution<double> normal;
  const int64_t size = c.m * c.n;
  std::vector<double> x(static_cast<std::size_t>(c.batch * size));
  for (int64_t t = 0; t < c.batch; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < size; ++i) ss += (x[t * size + i] = normal(rng)) * x[t * size + i];
    for (int64_t i = 0; i < size; ++i) x[t * size + i] /= std::sqrt(ss);
  }
  return x;
}

bool is_w(GramBuf b) { return b == GramBuf::kX0 || b == GramBuf::kX1 || b == GramBuf::kOut; }

// The program with a buffer of its own per name.
std::vector<double> run_separate(const Case& c, const GramProgram& p, const NsGemmPlan& plan) {
  std::array<std::vector<double>, kGramBufCount> buf;
  const auto storage = [&](GramBuf b) {
    std::vector<double>& v = buf[gram_buf_index(b)];
    if (v.empty()) v.assign(static_cast<std::size_t>(c.batch * (is_w(b) ? c.m * c.n : plan.square_stride)), NAN);
    return v.data();
  };
  const std::vector<double> x = normalized_input(c);
  std::copy(x.begin(), x.end(), storage(p.x_first));
  megatron_eopt::testing::run_gram_program(p, plan, c.batch, [&](std::size_t, int, GramBuf b) { return storage(b); });
  return buf[gram_buf_index(GramBuf::kOut)];
}

// The program placed with `pieces_per_w` pieces in each W buffer it uses, `gap` elements between
// pieces, all of it in one array: kOut, kX0, kX1, then the dedicated buffers.
std::vector<double> run_placed(const Case& c, const GramProgram& p, const NsGemmPlan& plan, int64_t pieces_per_w,
                               int64_t gap, GramPlacement* placed = nullptr) {
  const int64_t w_elems = c.batch * c.m * c.n, square = c.batch * plan.square_stride, stride = square + gap;
  std::array<int64_t, kGramBufCount> pieces{};
  for (GramBuf b : {GramBuf::kX0, GramBuf::kX1, GramBuf::kOut}) {
    const bool exists = b == GramBuf::kOut || p.uses[gram_buf_index(b)];
    if (exists) pieces[gram_buf_index(b)] = std::min(pieces_per_w, gram_pieces_in(w_elems, square, stride));
  }
  const GramPlacement placement = place_gram_values(p, pieces);
  if (placed != nullptr) *placed = placement;
  std::vector<double> arena(static_cast<std::size_t>(3 * w_elems + placement.dedicated * square), NAN);
  const auto w_base = [&](GramBuf b) {
    return arena.data() + (b == GramBuf::kOut ? 0 : b == GramBuf::kX0 ? w_elems : 2 * w_elems);
  };
  const std::vector<double> x = normalized_input(c);
  std::copy(x.begin(), x.end(), w_base(p.x_first));
  megatron_eopt::testing::run_gram_program(p, plan, c.batch, [&](std::size_t i, int operand, GramBuf b) {
    const int slot = placement.operand_slot.at(i)[static_cast<std::size_t>(operand)];
    EXPECT_EQ(slot >= 0, !is_w(b)) << "op " << i << " operand " << operand;
    if (slot < 0) return w_base(b);
    const GramSlot& home = placement.slots.at(static_cast<std::size_t>(slot));
    EXPECT_LT(home.index, home.region == GramBuf::kNone ? placement.dedicated : pieces[gram_buf_index(home.region)]);
    return home.region == GramBuf::kNone ? arena.data() + 3 * w_elems + home.index * square
                                         : w_base(home.region) + home.index * stride;
  });
  return std::vector<double>(arena.begin(), arena.begin() + w_elems);
}

std::vector<Case> cases() {
  std::vector<Case> all;
  const std::vector<std::array<int64_t, 3>> shapes = {{2, 4, 13}, {1, 3, 17}, {3, 6, 6}, {1, 1, 9}, {2, 5, 11}};
  for (const auto& sh : shapes) {
    for (bool transpose : {false, true}) {
      for (long steps : {1L, 2L, 3L, 5L, 8L}) {
        for (GramArithmetic ar : {GramArithmetic::kFp32, GramArithmetic::kBf16W, GramArithmetic::kTf32}) {
          for (bool polar : {false, true}) {
            // Transposed: the matrix is tall, n x m, so that the Gram side stays the short one.
            for (bool cpu : {false, true}) {
              if (cpu && ar != GramArithmetic::kBf16W) continue;  // the same program as the default
              all.push_back(transpose ? Case{sh[0], sh[2], sh[1], true, steps, ar, polar, cpu}
                                      : Case{sh[0], sh[1], sh[2], false, steps, ar, polar, cpu});
            }
          }
        }
      }
    }
  }
  return all;
}

}  // namespace

TEST(GramPlacement, PlacedProgramsComputeWhatSeparateBuffersDo) {
  for (const Case& c : cases()) {
    const GramProgram p = program_of(c);
    const NsGemmPlan plan = make_ns_gemm_plan(c.m, c.n, c.transpose);
    const std::vector<double> want = run_separate(c, p, plan);
    for (int64_t pieces : {0, 1, 2, 100}) {
      for (int64_t gap : {0, 3}) {
        const std::vector<double> got = run_placed(c, p, plan, pieces, gap);
        ASSERT_EQ(got.size(), want.size());
        for (std::size_t i = 0; i < want.size(); ++i) {
          ASSERT_FALSE(std::isnan(want[i]));
          ASSERT_EQ(got[i], want[i]) << "batch " << c.batch << " " << c.m << "x" << c.n << " transpose " << c.transpose
                                     << " steps " << c.steps << " pieces " << pieces << " gap " << gap << " at " << i;
        }
      }
    }
  }
}

TEST(GramPlacement, NeverNeedsMoreDedicatedBuffersThanTheProgramNames) {
  for (const Case& c : cases()) {
    const GramProgram p = program_of(c);
    int named = 0;
    for (GramBuf b : {GramBuf::kS0, GramBuf::kS1, GramBuf::kS2, GramBuf::kS3, GramBuf::kQx}) {
      named += p.uses[gram_buf_index(b)] ? 1 : 0;
    }
    const NsGemmPlan plan = make_ns_gemm_plan(c.m, c.n, c.transpose);
    for (int64_t pieces : {0, 1, 2, 100}) {
      GramPlacement placed{};
      run_placed(c, p, plan, pieces, 0, &placed);
      EXPECT_LE(placed.dedicated, named);
    }
  }
}

TEST(GramPlacement, QuinticFiveStepsNeedOneBufferInFp32AndNoneInBf16) {
  // A wide 2048 x 8192 MLP matrix's proportions: W holds four s x s matrices.
  const Case fp32{1, 4, 16, false, 5, GramArithmetic::kFp32, false};
  const Case bf16{1, 4, 16, false, 5, GramArithmetic::kBf16W, false};
  const NsGemmPlan plan = make_ns_gemm_plan(4, 16, false);
  GramPlacement placed{};
  // fp32: the input starts in kOut and a restart moves W to kX0. The final product reads Q while
  // it writes kOut, and kX0 holds W then: that Q alone needs a buffer of its own.
  run_placed(fp32, program_of(fp32), plan, 4, 0, &placed);
  EXPECT_EQ(placed.dedicated, 1);
  run_placed(fp32, program_of(fp32), plan, 0, 0, &placed);
  EXPECT_EQ(placed.dedicated, 4);  // nothing to alias: the program's four s x s buffers
  // bf16 W lives in kX0 and kX1, so kOut is free until the end, and two pieces of each suffice.
  run_placed(bf16, program_of(bf16), plan, 2, 0, &placed);
  EXPECT_EQ(placed.dedicated, 0);
  // The CPU's bf16 program keeps W in kOut and kX0 as fp32 does, plus Q's rounded copy: one buffer.
  const Case cpu{1, 4, 16, false, 5, GramArithmetic::kBf16W, false, true};
  const GramProgram cpu_program = program_of(cpu);
  EXPECT_FALSE(cpu_program.uses[gram_buf_index(GramBuf::kX1)]);
  run_placed(cpu, cpu_program, plan, 4, 0, &placed);
  EXPECT_EQ(placed.dedicated, 1);
}

TEST(GramLiveness, InputFromBeforeTheOpsResultToTheEnd) {
  const Case c{1, 4, 16, false, 5, GramArithmetic::kFp32, false};
  const GramProgram p = program_of(c);
  const GramLiveness live = gram_liveness(p);
  ASSERT_FALSE(live.values.empty());
  EXPECT_EQ(live.values.front().buf, p.x_first);
  EXPECT_EQ(live.values.front().first, kBeforeOps);
  int results = 0;
  for (const GramValue& v : live.values) {
    EXPECT_LE(v.first, v.last);
    if (v.last == static_cast<int>(p.ops.size())) {
      ++results;
      EXPECT_EQ(v.buf, GramBuf::kOut);
    }
  }
  EXPECT_EQ(results, 1);
  EXPECT_EQ(live.operand_value.size(), p.ops.size());
}

TEST(GramLiveness, RefusesAProgramThatReadsAnUnwrittenBuffer) {
  GramProgram p = program_of({1, 4, 16, false, 3, GramArithmetic::kFp32, false});
  p.ops.front().a = GramBuf::kS3;  // the first Gram product now reads an s x s buffer never written
  EXPECT_THROW(gram_liveness(p), std::logic_error);
  GramProgram no_result = program_of({1, 4, 16, false, 3, GramArithmetic::kFp32, false});
  no_result.ops.pop_back();  // the final product into kOut
  EXPECT_THROW(gram_liveness(no_result), std::logic_error);
}

TEST(GramPlacement, PiecesInABuffer) {
  EXPECT_EQ(gram_pieces_in(64, 16, 16), 4);
  EXPECT_EQ(gram_pieces_in(63, 16, 16), 3);
  EXPECT_EQ(gram_pieces_in(60, 15, 16), 3);  // the last piece needs no padding after it
  EXPECT_EQ(gram_pieces_in(63, 15, 16), 4);
  EXPECT_EQ(gram_pieces_in(14, 15, 16), 0);
  EXPECT_EQ(gram_pieces_in(64, 0, 16), 0);
  EXPECT_EQ(gram_pieces_in(64, 17, 16), 0);  // a stride shorter than a piece would overlap
}
