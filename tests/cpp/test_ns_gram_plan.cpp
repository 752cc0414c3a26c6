// Gram Newton–Schulz programs (ns_gram_plan.h) and the algorithm choice (ns_algorithm.h).
//
// The numerical test runs each program exactly as the CUDA executor does: every GEMM through its
// column-major GemmShape of make_ns_gemm_plan (operand order, leading dimensions, batch strides),
// here with a reference GEMM in double, and checks the result against the standard iteration
// evaluated directly on row-major matrices: in exact arithmetic the two are the same iteration.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "megatron_eopt/ns_algorithm.h"
#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_gram_plan.h"
#include "reference_gemm.h"
#include "reference_gram.h"

using namespace megatron_eopt;

namespace {

const std::vector<double> kQuintic = {4.0848, -6.8946, 2.9270,  3.9505, -6.3029, 2.6377,  3.7418, -5.5913,
                                      2.3037, 2.8769,  -3.1427, 1.2046, 2.8366,  -3.0525, 1.2012};
const std::vector<double> kPolar = {8.2051, -22.9019, 16.4607, 4.0664, -2.8612, 0.5184, 3.9096, -2.8234, 0.5250};

// Polar Express repeats its last row past its table (cycling back to its steep first row would
// diverge from a converged spectrum); quintic cycles.
std::vector<NsCoefficients> schedule(const std::vector<double>& table, long steps) {
  return expand_schedule(table, steps, &table == &kPolar ? SchedulePolicy::kRepeatLast : SchedulePolicy::kCycle);
}

// The standard iteration (docs/design.md §4.1) on row-major X (batch, m, n), exactly, from normalized input.
std::vector<double> direct_standard(std::vector<double> x, int64_t batch, int64_t m, int64_t n, bool transpose,
                                    const std::vector<NsCoefficients>& sched) {
  for (const NsCoefficients& co : sched) {
    x = megatron_eopt::testing::reference_ns_step(x, batch, m, n, transpose, co.a, co.b, co.c);
  }
  return x;
}

// Runs `program` op by op like the CUDA executor: one GemmShape per GEMM, each buffer its own
// storage (NaN until written). `square_ld`: leading dimension of the s x s buffers (0: unpadded),
// as the CUDA layout pads it.
std::vector<double> run_program(const GramProgram& program, const std::vector<double>& x0, int64_t batch, int64_t m,
                                int64_t n, bool transpose, int64_t square_ld = 0) {
  const NsGemmPlan plan = make_ns_gemm_plan(m, n, transpose, square_ld);
  std::map<GramBuf, std::vector<double>> buf;
  std::set<GramBuf> written = {program.x_first};
  buf[program.x_first] = x0;
  megatron_eopt::testing::run_gram_program(program, plan, batch, [&](std::size_t i, int operand, GramBuf b) {
    if (operand == 3) {
      written.insert(b);
    } else {
      EXPECT_TRUE(written.count(b)) << "op " << i << " reads an unwritten buffer";
    }
    const bool square = b != GramBuf::kX0 && b != GramBuf::kX1 && b != GramBuf::kOut;
    std::vector<double>& v = buf[b];
    if (v.empty()) v.assign(static_cast<std::size_t>(batch * (square ? plan.square_stride : m * n)), std::nan(""));
    return v.data();
  });
  return buf.at(GramBuf::kOut);
}

void check_program_matches_standard(int64_t batch, int64_t m, int64_t n, bool transpose, long steps,
                                    GramArithmetic arithmetic, const std::vector<double>& table,
                                    std::optional<bool> w_in_out = {}) {
  std::mt19937 rng(static_cast<unsigned>(m * 977 + n * 31 + steps * 7 + transpose));
  std::normal_distribution<double> normal;
  std::vector<double> x(batch * m * n);
  for (int64_t t = 0; t < batch; ++t) {  // Frobenius-normalized, as the executors' first pass leaves it
    double ss = 0;
    for (int64_t i = 0; i < m * n; ++i) ss += (x[t * m * n + i] = normal(rng)) * x[t * m * n + i];
    for (int64_t i = 0; i < m * n; ++i) x[t * m * n + i] /= std::sqrt(ss);
  }
  const auto sched = schedule(table, steps);
  const auto restart = gram_restarts(sched, arithmetic);
  const GramProgram program = make_gram_program(m, n, transpose, sched, restart, arithmetic == GramArithmetic::kBf16W,
                                                w_in_out);
  const auto want = direct_standard(x, batch, m, n, transpose, sched);
  // The padded layout (NaN in the padding) must give the same values as the dense one.
  const auto padded = run_program(program, x, batch, m, n, transpose, padded_square_ld(program.gram_side) + 8);
  const auto got = run_program(program, x, batch, m, n, transpose);
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(padded[i], got[i]) << "padded layout differs at " << i;
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    err += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  EXPECT_LE(std::sqrt(err / norm), 1e-10)
      << "batch=" << batch << " m=" << m << " n=" << n << " transpose=" << transpose << " steps=" << steps;
}

}  // namespace

// ------------------------------------------------------------------ restarts
TEST(GramRestarts, CadencePerArithmeticAndSchedule) {
  const auto quintic = schedule(kQuintic, 5);
  EXPECT_EQ(gram_restarts(quintic, GramArithmetic::kFp32), (std::vector<bool>{false, false, false, true, false}));
  EXPECT_EQ(gram_restarts(quintic, GramArithmetic::kBf16W), (std::vector<bool>{false, false, false, true, false}));
  EXPECT_EQ(gram_restarts(schedule(kQuintic, 4), GramArithmetic::kTf32), (std::vector<bool>{false, true, true, true}));
  // polar_express's first row (a = 8.2) is steep: fp32 restarts every two steps; bf16 W keeps three.
  const auto polar = schedule(kPolar, 5);
  EXPECT_EQ(gram_restarts(polar, GramArithmetic::kFp32), (std::vector<bool>{false, false, true, false, true}));
  EXPECT_EQ(gram_restarts(polar, GramArithmetic::kBf16W), (std::vector<bool>{false, false, false, true, false}));
  EXPECT_EQ(gram_restarts(schedule(kQuintic, 10), GramArithmetic::kFp32),
            (std::vector<bool>{false, false, false, true, false, false, true, false, false, true}));
  EXPECT_EQ(gram_restarts(schedule(kQuintic, 1), GramArithmetic::kFp32), std::vector<bool>{false});
  EXPECT_EQ(gram_restarts(schedule(kQuintic, 3), GramArithmetic::kFp32), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(gram_restart_interval(GramArithmetic::kFp32, {{-7.f, 1.f, 0.f}}), 2);  // |a| counts
}

// ------------------------------------------------------------------ program structure
TEST(GramProgram, BuffersAreNeverReadWhileWrittenAndEndInOut) {
  for (bool bf16 : {false, true}) {
    for (long steps : {1L, 2L, 3L, 5L, 8L}) {
      for (GramArithmetic ar : {GramArithmetic::kFp32, GramArithmetic::kBf16W, GramArithmetic::kTf32}) {
        const auto sched = schedule(kQuintic, steps);
        const auto restart = gram_restarts(sched, ar);
        const GramProgram p = make_gram_program(40, 100, false, sched, restart, bf16);
        int applies = 0, grams = 0, rounds = 0;
        for (const GramOp& op : p.ops) {
          if (op.kind == GramOpKind::kGemm) {
            EXPECT_NE(op.d, op.a);
            EXPECT_NE(op.d, op.b);
            if (op.beta != 0.f) EXPECT_NE(op.d, op.c);  // cuBLASLt may alias C and D, never A/B
            applies += op.gemm == GramGemm::kApply;
            grams += op.gemm == GramGemm::kGram;
            if (op.gemm == GramGemm::kApply) {
              const GramBuf q = op.b;  // wide: (X, Q)
              EXPECT_EQ(q == GramBuf::kQx, bf16) << "Q is rounded to the W type exactly when W is bf16";
              if (!bf16) EXPECT_NE(op.a, GramBuf::kQx);
            }
          }
          rounds += op.kind == GramOpKind::kRound;
          if (!bf16) EXPECT_NE(op.d, GramBuf::kQx);
          // bf16 W never lives in kOut: only the final product writes it.
          if (bf16 && op.d == GramBuf::kOut) EXPECT_EQ(&op, &p.ops.back());
        }
        EXPECT_EQ(applies, p.restarts + 1);
        EXPECT_EQ(grams, p.restarts + 1);
        EXPECT_EQ(rounds, bf16 ? p.restarts + 1 : 0);
        const GramOp& last = p.ops.back();
        EXPECT_EQ(last.kind, GramOpKind::kGemm);
        EXPECT_EQ(last.gemm, GramGemm::kApply);
        EXPECT_EQ(last.d, GramBuf::kOut);
        EXPECT_NE(last.a, GramBuf::kOut);
        EXPECT_NE(last.b, GramBuf::kOut);
        // bf16 W cannot live in the fp32 output; fp32 W may (so no second W buffer is needed).
        EXPECT_EQ(p.uses[gram_buf_index(GramBuf::kX1)], bf16 && p.restarts > 0);
        if (bf16) EXPECT_NE(p.x_first, GramBuf::kOut);
      }
    }
  }
}

TEST(GramProgram, TallOperandOrderPutsQFirst) {
  const auto sched = schedule(kQuintic, 5);
  const GramProgram p = make_gram_program(100, 40, true, sched, gram_restarts(sched, GramArithmetic::kFp32), false);
  EXPECT_EQ(p.gram_side, 40);
  EXPECT_EQ(p.long_side, 100);
  for (const GramOp& op : p.ops) {
    if (op.kind == GramOpKind::kGemm && op.gemm == GramGemm::kApply) {
      EXPECT_TRUE(op.a == GramBuf::kS0 || op.a == GramBuf::kS1 || op.a == GramBuf::kS2 || op.a == GramBuf::kS3);
    }
  }
}

TEST(GramProgram, RejectsMismatchedRestarts) {
  const auto sched = schedule(kQuintic, 5);
  EXPECT_THROW(make_gram_program(4, 8, false, sched, std::vector<bool>(4, false), false), std::invalid_argument);
  EXPECT_THROW(make_gram_program(4, 8, false, {}, {}, false), std::invalid_argument);
}

// ------------------------------------------------------------------ numerics through the GEMM plan
TEST(GramProgram, EqualsTheStandardIterationWide) {
  for (GramArithmetic ar : {GramArithmetic::kFp32, GramArithmetic::kBf16W, GramArithmetic::kTf32}) {
    check_program_matches_standard(2, 5, 11, false, 5, ar, kQuintic);
    check_program_matches_standard(1, 1, 9, false, 3, ar, kQuintic);
    check_program_matches_standard(3, 6, 6, false, 4, ar, kPolar);
  }
}

TEST(GramProgram, EqualsTheStandardIterationTall) {
  for (GramArithmetic ar : {GramArithmetic::kFp32, GramArithmetic::kBf16W, GramArithmetic::kTf32}) {
    check_program_matches_standard(2, 11, 5, true, 5, ar, kQuintic);
    check_program_matches_standard(2, 9, 1, true, 2, ar, kQuintic);
    check_program_matches_standard(1, 13, 7, true, 7, ar, kPolar);
  }
}

TEST(GramProgram, EqualsTheStandardIterationWithForcedTranspose) {
  check_program_matches_standard(2, 4, 9, true, 5, GramArithmetic::kFp32, kQuintic);
  check_program_matches_standard(2, 9, 4, false, 5, GramArithmetic::kBf16W, kQuintic);
}

TEST(GramProgram, TheCpuBf16ProgramKeepsWInTheOutput) {
  // The CPU holds bf16 W values in fp32 buffers: W alternates between kX0 and kOut as in fp32, Q
  // is still rounded before each product with W, and the arithmetic is the same iteration.
  const auto sched = schedule(kQuintic, 5);
  const GramProgram p = make_gram_program(40, 100, false, sched, gram_restarts(sched, GramArithmetic::kBf16W), true,
                                          true);
  EXPECT_TRUE(p.x_bf16);
  EXPECT_TRUE(p.x_in_out);
  EXPECT_FALSE(p.uses[gram_buf_index(GramBuf::kX1)]);
  EXPECT_EQ(p.x_first, GramBuf::kOut);  // one restart: kOut, then kX0, then the result in kOut
  int rounds = 0;
  for (const GramOp& op : p.ops) rounds += op.kind == GramOpKind::kRound;
  EXPECT_EQ(rounds, p.restarts + 1);
  check_program_matches_standard(2, 5, 11, false, 5, GramArithmetic::kBf16W, kQuintic, true);
  check_program_matches_standard(2, 11, 5, true, 8, GramArithmetic::kBf16W, kPolar, true);
}

TEST(GramProgram, SingleStepAndLongSchedules) {
  check_program_matches_standard(1, 4, 10, false, 1, GramArithmetic::kFp32, kQuintic);
  check_program_matches_standard(2, 4, 10, false, 10, GramArithmetic::kFp32, kQuintic);
  check_program_matches_standard(2, 10, 4, true, 10, GramArithmetic::kBf16W, kPolar);
}

// ------------------------------------------------------------------ FLOPs and the auto rule
TEST(GramFlops, CountsEveryProductOnce) {
  const auto sched = schedule(kQuintic, 5);
  const double s = 8, l = 32;
  // Restarts before steps 2 and 4. W W^T: 3; Q W: 3 (two restarts + final).
  // s x s: steps 0, 2 open a segment and update R (P, R P, P R P = 3); steps 1, 3 close one
  // (P, Q P = 2); step 4 opens and closes one (P = 1): 3 + 2 + 3 + 2 + 1 = 11.
  const GramProgram p = make_gram_program(8, 32, false, sched, {false, false, true, false, true}, false);
  const NsFlops f = gram_program_flops(p);
  EXPECT_DOUBLE_EQ(f.long_symmetric, 3 * 2 * s * s * l);
  EXPECT_DOUBLE_EQ(f.long_general, 3 * 2 * s * s * l);
  EXPECT_DOUBLE_EQ(f.square, 11 * 2 * s * s * s);
  const NsFlops st = standard_flops(8, 32, false, 5);
  EXPECT_DOUBLE_EQ(st.long_symmetric, 5 * 2 * s * s * l);
  EXPECT_DOUBLE_EQ(st.long_general, 5 * 2 * s * s * l);
  EXPECT_DOUBLE_EQ(st.square, 5 * 2 * s * s * s);
  // Transposed: the Gram side is the column count.
  EXPECT_DOUBLE_EQ(standard_flops(32, 8, true, 1).long_general, 2 * s * s * l);
}

TEST(GramFlops, SymmetricBlocks) {
  EXPECT_EQ(ns_symmetric_blocks(128, NsDevice::kCpu), 1);
  EXPECT_EQ(ns_symmetric_blocks(512, NsDevice::kCpu), 2);
  EXPECT_EQ(ns_symmetric_blocks(768, NsDevice::kCpu), 3);
  EXPECT_EQ(ns_symmetric_blocks(1024, NsDevice::kCpu), 4);
  EXPECT_EQ(ns_symmetric_blocks(1536, NsDevice::kCpu), 6);
  EXPECT_EQ(ns_symmetric_blocks(8192, NsDevice::kCpu), 8);
  EXPECT_EQ(ns_symmetric_blocks(8192, NsDevice::kCuda), 1);
  EXPECT_DOUBLE_EQ(ns_symmetric_fraction(1), 1.0);
  EXPECT_DOUBLE_EQ(ns_symmetric_fraction(4), 0.625);
}

TEST(NsAlgorithmChoice, ExplicitRequestsAreHonoured) {
  const auto sched = schedule(kQuintic, 5);
  EXPECT_EQ(choose_ns_algorithm(NsAlgorithm::kStandard, 1024, 4096, false, sched, NsPrecision::kHighest, NsDevice::kCpu)
                .algorithm,
            NsAlgorithm::kStandard);
  const auto gram = choose_ns_algorithm(NsAlgorithm::kGram, 3, 3, false, sched, NsPrecision::kMedium, NsDevice::kCuda);
  EXPECT_EQ(gram.algorithm, NsAlgorithm::kGram);
  EXPECT_FALSE(gram.program.ops.empty());
}

TEST(NsAlgorithmChoice, ResultOverwritesTheInputOnlyWhereTheNormalizationWritesElsewhere) {
  // Standard: the normalized input lands in iterate[steps % 2]; with fp32 iterates iterate[0] is the
  // output, with bf16 ones ("medium") both are scratch.
  const NsAlgorithmChoice standard{NsAlgorithm::kStandard, {}};
  for (std::size_t steps : {1u, 2u, 4u, 5u}) {
    EXPECT_TRUE(cuda_result_may_overwrite_input(standard, NsPrecision::kMedium, steps));
    for (NsPrecision p : {NsPrecision::kHigh, NsPrecision::kHighest}) {
      EXPECT_EQ(cuda_result_may_overwrite_input(standard, p, steps), steps % 2 == 1);
    }
  }
  // Gram: wherever the program puts its first W; both cases occur.
  bool seen[2] = {false, false};
  for (NsPrecision p : {NsPrecision::kMedium, NsPrecision::kHighest}) {
    for (int steps : {1, 2, 3, 4, 5, 8}) {
      for (bool transpose : {false, true}) {
        const auto sched = schedule(kQuintic, steps);
        const auto choice = choose_ns_algorithm(NsAlgorithm::kGram, 40, 100, transpose, sched, p, NsDevice::kCuda);
        const bool in_out = choice.program.x_first == GramBuf::kOut;
        EXPECT_EQ(cuda_result_may_overwrite_input(choice, p, sched.size()), !in_out);
        if (p == NsPrecision::kMedium) EXPECT_FALSE(in_out);  // bf16 W never lives in the fp32 output
        seen[in_out] = true;
      }
    }
  }
  EXPECT_TRUE(seen[0]);
  EXPECT_TRUE(seen[1]);
}

TEST(NsAlgorithmChoice, AutoKeepsStandardForSchedulesThatDoNotOrthogonalize) {
  // Emerging-Optimizers' custom-coefficient test schedule: singular values grow to 15, then ~1.3e7.
  const std::vector<NsCoefficients> wild = {{3.f, 5.f, 7.f}, {11.f, 13.f, 17.f}};
  EXPECT_GT(ns_schedule_peak(wild), 1e7);
  EXPECT_LT(ns_schedule_peak(schedule(kQuintic, 5)), 2.0);
  EXPECT_LT(ns_schedule_peak(schedule(kPolar, 3)), kGramMaxSchedulePeak);
  EXPECT_DOUBLE_EQ(ns_schedule_peak({}), 1.0);
  for (NsDevice d : {NsDevice::kCpu, NsDevice::kCuda}) {
    EXPECT_EQ(choose_ns_algorithm(NsAlgorithm::kAuto, 1024, 4096, false, wild, NsPrecision::kHighest, d).algorithm,
              NsAlgorithm::kStandard);
    EXPECT_EQ(choose_ns_algorithm(NsAlgorithm::kGram, 1024, 4096, false, wild, NsPrecision::kHighest, d).algorithm,
              NsAlgorithm::kGram);  // asked for: runs
    EXPECT_EQ(
        choose_ns_algorithm(NsAlgorithm::kAuto, 1024, 4096, false, schedule(kQuintic, 5), NsPrecision::kHighest, d)
            .algorithm,
        NsAlgorithm::kGram);  // an orthogonalizing schedule still takes Gram where it pays
  }
}

TEST(NsAlgorithmChoice, AutoOnTheCpu) {
  const auto sched = schedule(kQuintic, 5);
  const auto pick = [&](int64_t m, int64_t n, NsPrecision p) {
    return choose_ns_algorithm(NsAlgorithm::kAuto, m, n, m > n, sched, p, NsDevice::kCpu).algorithm;
  };
  for (NsPrecision p : {NsPrecision::kHighest, NsPrecision::kHigh}) {
    EXPECT_EQ(pick(1024, 4096, p), NsAlgorithm::kGram);
    EXPECT_EQ(pick(4096, 1024, p), NsAlgorithm::kGram);
    EXPECT_EQ(pick(768, 3072, p), NsAlgorithm::kGram);
    EXPECT_EQ(pick(1024, 1024, p), NsAlgorithm::kStandard);
    EXPECT_EQ(pick(64, 256, p), NsAlgorithm::kStandard);  // too small to gain
    EXPECT_EQ(pick(128, 512, p), NsAlgorithm::kGram);
  }
  EXPECT_EQ(pick(128, 192, NsPrecision::kHighest), NsAlgorithm::kStandard);  // modelled 1.0x
  EXPECT_EQ(pick(128, 256, NsPrecision::kHighest), NsAlgorithm::kGram);      // modelled 1.14x
  EXPECT_EQ(pick(1024, 2048, NsPrecision::kHighest), NsAlgorithm::kGram);
  // "medium": the standard iteration's bf16 GEMMs against the Gram iteration's fp32 products.
  EXPECT_EQ(pick(1024, 4096, NsPrecision::kMedium), NsAlgorithm::kStandard);
  EXPECT_EQ(pick(768, 3072, NsPrecision::kMedium), NsAlgorithm::kStandard);
  EXPECT_EQ(pick(1024, 65536, NsPrecision::kMedium), NsAlgorithm::kStandard);  // at most 1.0x modelled
}

TEST(NsAlgorithmChoice, AutoOnCuda) {
  const auto sched = schedule(kQuintic, 5);
  const auto pick = [&](int64_t m, int64_t n, NsPrecision p) {
    return choose_ns_algorithm(NsAlgorithm::kAuto, m, n, m > n, sched, p, NsDevice::kCuda).algorithm;
  };
  EXPECT_EQ(pick(1024, 4096, NsPrecision::kHighest), NsAlgorithm::kGram);
  EXPECT_EQ(pick(4096, 1024, NsPrecision::kHighest), NsAlgorithm::kGram);
  EXPECT_EQ(pick(1024, 3072, NsPrecision::kHighest), NsAlgorithm::kGram);
  EXPECT_EQ(pick(1024, 2048, NsPrecision::kHighest), NsAlgorithm::kStandard);  // modelled 1.14x: under the margin
  EXPECT_EQ(pick(256, 4096, NsPrecision::kHighest), NsAlgorithm::kStandard);  // launch-bound
  // TF32 needs a restart at every step and bf16 W keeps fp32 s x s products: never a gain.
  EXPECT_EQ(pick(1024, 16384, NsPrecision::kHigh), NsAlgorithm::kStandard);
  EXPECT_EQ(pick(1024, 16384, NsPrecision::kMedium), NsAlgorithm::kStandard);
}

TEST(NsAlgorithmChoice, ParsesNames) {
  EXPECT_EQ(parse_ns_algorithm("auto"), NsAlgorithm::kAuto);
  EXPECT_EQ(parse_ns_algorithm("standard"), NsAlgorithm::kStandard);
  EXPECT_EQ(parse_ns_algorithm("gram"), NsAlgorithm::kGram);
  try {
    parse_ns_algorithm("fast");
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("algorithm must be one of auto, standard, gram"), std::string::npos);
  }
}

TEST(NsAlgorithmChoice, ArithmeticPerPrecisionAndDevice) {
  EXPECT_EQ(gram_arithmetic(NsPrecision::kHigh, NsDevice::kCuda), GramArithmetic::kTf32);
  EXPECT_EQ(gram_arithmetic(NsPrecision::kHigh, NsDevice::kCpu), GramArithmetic::kFp32);
  EXPECT_EQ(gram_arithmetic(NsPrecision::kHighest, NsDevice::kCuda), GramArithmetic::kFp32);
  EXPECT_EQ(gram_arithmetic(NsPrecision::kMedium, NsDevice::kCpu), GramArithmetic::kBf16W);
  EXPECT_EQ(gram_arithmetic(NsPrecision::kMedium, NsDevice::kCuda), GramArithmetic::kBf16W);
}

// ------------------------------------------------------------------ what the CUDA executor relies on
TEST(GramProgram, OperandTypesAgreeAsCublasLtRequires) {
  for (bool bf16 : {false, true}) {
    for (bool transpose : {false, true}) {
      const auto sched = schedule(kQuintic, 7);
      const auto restart = gram_restarts(sched, bf16 ? GramArithmetic::kBf16W : GramArithmetic::kFp32);
      const GramProgram p = make_gram_program(transpose ? 60 : 20, transpose ? 20 : 60, transpose, sched, restart,
                                              bf16);
      EXPECT_EQ(p.transpose, transpose);
      EXPECT_EQ(p.x_bf16, bf16);
      EXPECT_EQ(gram_buf_is_bf16(p, GramBuf::kOut), false);
      for (const GramOp& op : p.ops) {
        switch (op.kind) {
          case GramOpKind::kGemm:
            EXPECT_EQ(gram_buf_is_bf16(p, op.a), gram_buf_is_bf16(p, op.b));  // A and B share a type
            if (op.beta != 0.f) EXPECT_EQ(gram_buf_is_bf16(p, op.c), gram_buf_is_bf16(p, op.d));
            if (op.gemm == GramGemm::kSquare) {
              EXPECT_FALSE(gram_buf_is_bf16(p, op.a) || gram_buf_is_bf16(p, op.d));  // R, P, Q stay fp32
            }
            if (op.gemm == GramGemm::kGram) EXPECT_FALSE(gram_buf_is_bf16(p, op.d));
            break;
          case GramOpKind::kAddDiag: EXPECT_FALSE(gram_buf_is_bf16(p, op.d)); break;
          case GramOpKind::kRound:
            EXPECT_FALSE(gram_buf_is_bf16(p, op.a));
            EXPECT_TRUE(gram_buf_is_bf16(p, op.d));
            break;
        }
      }
    }
  }
}

TEST(GramScratchLayout, AlignedDisjointAndSized) {
  const int64_t batch = 3, m = 37, n = 101;  // odd sizes: every offset must still be 256-aligned
  for (bool bf16 : {false, true}) {
    for (long steps : {1L, 2L, 5L}) {
      const auto sched = schedule(kQuintic, steps);
      const auto restart = gram_restarts(sched, bf16 ? GramArithmetic::kBf16W : GramArithmetic::kFp32);
      const GramProgram p = make_gram_program(m, n, false, sched, restart, bf16);
      const GramScratchLayout l = gram_scratch_layout(p, batch, m, n, 17);
      std::vector<std::pair<std::size_t, std::size_t>> spans;
      for (int i = 0; i < kGramBufCount; ++i) {
        const GramBuf b = static_cast<GramBuf>(i);
        if (b == GramBuf::kOut || b == GramBuf::kNone || !p.uses[i]) {
          EXPECT_EQ(l.offset[i], kNoOffset) << i;
          continue;
        }
        ASSERT_NE(l.offset[i], kNoOffset) << i;
        EXPECT_EQ(l.offset[i] % 256, 0u);
        const bool w = b == GramBuf::kX0 || b == GramBuf::kX1;
        // s x s buffers hold padded rows (leading dimension padded_square_ld(s)).
        const std::size_t square = static_cast<std::size_t>(padded_square_ld(p.gram_side) * p.gram_side);
        const std::size_t bytes = static_cast<std::size_t>(batch) * (w ? m * n : square) *
                                  (gram_buf_is_bf16(p, b) ? 2 : 4);
        spans.push_back({l.offset[i], l.offset[i] + bytes});
      }
      spans.push_back({l.sum_squares, l.sum_squares + batch * sizeof(float)});
      spans.push_back({l.norm_partials, l.norm_partials + 17 * sizeof(float)});
      EXPECT_EQ(l.sum_squares % 256, 0u);
      EXPECT_EQ(l.norm_partials % 256, 0u);
      std::sort(spans.begin(), spans.end());
      for (std::size_t k = 1; k < spans.size(); ++k) EXPECT_LE(spans[k - 1].second, spans[k].first);
      EXPECT_LE(spans.back().second, l.total);
    }
  }
}
