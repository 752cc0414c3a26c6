// Gram Newton–Schulz (docs/design.md §4.4): the same iteration as §4.1, run on the small Gram matrix.
//
// With W the working matrix (X, or X^T when iterating transposed; s x l, s the Gram side),
// R = W W^T is s x s. One step with coefficients (a, b, c) is W <- (a I + b R + c R^2) W. Every
// factor is a polynomial in R, so instead of updating W (two s x l products per step) the Gram
// iteration keeps
//   P = a I + b R + c R^2,   Q <- Q P,   R <- P R P
// (all s x s) and forms W = Q W0 once at the end. A restart (W0 <- Q W0, R <- W0 W0^T, Q <- I)
// bounds the rounding the s x s recursion accumulates; the last step of a segment skips its R
// update, the first takes Q = P without a product. Every s x s product is symmetric (polynomials
// in one R commute), which lets a backend compute half of it (CPU: ns_symmetric_blocks).
//
// This header turns a schedule into that sequence of operations, a "program" over named buffers,
// which the CPU executor (ATen) and the CUDA executor (cuBLASLt, kernels/newton_schulz_gram.cu)
// run op by op. The GEMM shapes come from ns_gemm_plan.h (column-major view of row-major X), so
// the tall case never materializes a transpose. Torch- and CUDA-free: GoogleTest runs programs
// through a reference GEMM.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_schedule.h"
#include "megatron_eopt/ns_scratch_layout.h"

namespace megatron_eopt {

// ------------------------------------------------------------------ restarts
// How the products that form and update R are rounded, which sets how often R is recomputed.
//   kFp32:   fp32 storage and products ("highest"; "high" on a CPU).
//   kBf16W:  W stored in bf16 ("medium"), R and Q in fp32 with fp32 products.
//   kTf32:   fp32 storage, TF32 products ("high" on CUDA).
enum class GramArithmetic { kFp32, kBf16W, kTf32 };

// A row whose a exceeds this is "steep" (polar_express's 8.21, cans's 8.47, against at most 4.1
// in simple, quintic, aol and deepseekv4): near zero it multiplies an eigenvalue of R, and the
// rounding error on it, by a^2 = 70 in one step.
constexpr float kSteepRowA = 6.0f;

// Restart every `interval` steps (before steps interval, 2 interval, ...), chosen per schedule
// and arithmetic. Why these values: forming R squares the condition number of the rounding it
// carries (an error e in R is a relative error e / sigma^2 on a singular value sigma, against
// e / sigma for the standard iteration), and the recursion multiplies it by about a^2 per step;
// recomputing R from the current W, whose small singular values have grown meanwhile, resets it.
//   kFp32, every 3 steps, every 2 with a steep row: measured against the float64 standard
//     iteration on Gaussian (1 x n, n x 1, 97 x 37, square, batched), rank-deficient and
//     log-spectrum (1 .. 1e-6) inputs, the Gram result stays within the §9 tolerance wherever
//     the standard fp32 iteration does, and within 2x of the standard's own error on the inputs
//     where neither does (rank-deficient ones: quintic 1.6x, simple and aol 1.1x with one restart
//     in five steps). A steep row needs the shorter segments: one restart left polar_express and
//     cans 3x to 6x off there, two bring them to 1.0x and 1.8x.
//   kBf16W, every 3 steps: each restart also rounds W to bf16, an error the remaining steps
//     amplify like the standard iteration's per-step rounding, so fewer, later restarts are more
//     accurate: within the §9 bf16 tolerance (2e-2) wherever the standard bf16 iteration is, and
//     more accurate than it on most inputs (two bf16 roundings of W instead of one per step).
//   kTf32, every step: a TF32-rounded R is off by 5e-4, which no restart cadence that saves work
//     brings back within the TF32 tolerance on rank-deficient inputs; restarting at every step
//     makes the Gram iteration the standard one re-associated (same products, same cost), so
//     "auto" never picks it there (see ns_algorithm.h).
// Validated for every built-in schedule by tests/python/test_newton_schulz_gram.py.
inline int gram_restart_interval(GramArithmetic arithmetic, const std::vector<NsCoefficients>& schedule) {
  switch (arithmetic) {
    case GramArithmetic::kFp32:
      for (const NsCoefficients& row : schedule) {
        if (row.a > kSteepRowA || row.a < -kSteepRowA) return 2;
      }
      return 3;
    case GramArithmetic::kBf16W: return 3;
    case GramArithmetic::kTf32: return 1;
  }
  return 1;
}

// restart[k] is true when step k starts a new segment (restart[0] is always false: step 0 starts
// the first segment from the normalized input).
inline std::vector<bool> gram_restarts(const std::vector<NsCoefficients>& schedule, GramArithmetic arithmetic) {
  const std::size_t interval = static_cast<std::size_t>(gram_restart_interval(arithmetic, schedule));
  std::vector<bool> restart(schedule.size(), false);
  for (std::size_t k = interval; k < schedule.size(); k += interval) restart[k] = true;
  return restart;
}

// ------------------------------------------------------------------ program
// Buffers of a program. kX0 / kX1 hold W0 in the "x type" (bf16 for precision medium, else fp32);
// kOut is the fp32 output (also usable as an fp32 W0, see GramProgram::x_in_out); kS0..kS3 are
// fp32 s x s matrices (R, P, R P and Q rotate through them); kQx is Q rounded to the x
// type, for the products with W0 when that type is bf16.
enum class GramBuf : uint8_t { kNone, kX0, kX1, kOut, kS0, kS1, kS2, kS3, kQx };
constexpr int kGramBufCount = 9;

enum class GramOpKind : uint8_t {
  kGemm,     // d = alpha * a . b + beta * c (beta == 0: c is not read)
  kAddDiag,  // d += alpha * I, in place
  kRound,    // d = a rounded to the x type (bf16)
};

// Which product a GEMM is, and so its GemmShape in NsGemmPlan:
//   kGram   d = W W^T              (a = b = an x buffer; s x s result)       plan.gram_gemm
//   kSquare d = a . b (+ beta c)   (s x s operands)                          plan.poly_gemm
//   kApply  d = Q W, as row-major X: Q X (wide) or X Q (tall)                plan.update_gemm
//           (operands ordered (X, Q) wide and (Q, X) tall, as the column-major plan reads them)
enum class GramGemm : uint8_t { kGram, kSquare, kApply };

struct GramOp {
  GramOpKind kind;
  GramGemm gemm;  // kGemm only
  GramBuf a, b, c, d;
  float alpha, beta;
};

struct GramProgram {
  std::vector<GramOp> ops;
  GramBuf x_first;          // where the normalized input W0 goes
  bool transpose;           // iterating on X^T: the Gram side is the column count
  bool x_bf16;              // W (kX0, kX1) and kQx are bf16; everything else is fp32
  bool x_in_out;            // kOut serves as a W buffer (no kX1 then)
  bool uses[kGramBufCount]; // buffers the program touches (scratch to allocate)
  int restarts;
  int64_t gram_side, long_side;  // s and l
};

inline std::size_t gram_buf_index(GramBuf b) { return static_cast<std::size_t>(b); }

// m, n: rows and columns of each row-major matrix; transpose: iterate on X^T (Gram side n);
// x_bf16: W holds bf16 values (precision medium), so Q is rounded (kQx) before the products with W.
// w_in_out: kOut may hold W; by default only when W is fp32 (CUDA stores bf16 W in bf16 buffers,
// which the fp32 output cannot be; the CPU keeps bf16 values in fp32 buffers, so it can).
inline GramProgram make_gram_program(int64_t m, int64_t n, bool transpose, const std::vector<NsCoefficients>& schedule,
                                     const std::vector<bool>& restart, bool x_bf16, std::optional<bool> w_in_out = {}) {
  if (schedule.empty() || restart.size() != schedule.size()) {
    throw std::invalid_argument("restart must have one entry per schedule step");
  }
  GramProgram p{};
  p.gram_side = transpose ? n : m;
  p.long_side = transpose ? m : n;
  p.transpose = transpose;
  p.x_bf16 = x_bf16;
  p.x_in_out = w_in_out.value_or(!x_bf16);
  int restarts = 0;
  for (std::size_t k = 1; k < restart.size(); ++k) restarts += restart[k] ? 1 : 0;
  p.restarts = restarts;

  // W buffers: W_0 .. W_restarts. The final product reads W_restarts and writes kOut, so
  // W_restarts must not be kOut; consecutive ones must differ (a restart reads one, writes the next).
  std::vector<GramBuf> w(static_cast<std::size_t>(restarts) + 1);
  for (int j = restarts; j >= 0; --j) {
    const bool even_from_last = (restarts - j) % 2 == 0;
    if (p.x_in_out) {
      w[j] = even_from_last ? GramBuf::kX0 : GramBuf::kOut;
    } else {
      w[j] = (j % 2 == 0) ? GramBuf::kX0 : GramBuf::kX1;
    }
  }
  p.x_first = w[0];

  // s x s buffers rotate: `free_` is a stack of unused ones.
  std::vector<GramBuf> free_ = {GramBuf::kS3, GramBuf::kS2, GramBuf::kS1, GramBuf::kS0};
  const auto take = [&free_]() {
    if (free_.empty()) throw std::logic_error("gram program: out of s x s buffers");
    const GramBuf b = free_.back();
    free_.pop_back();
    return b;
  };
  const auto give = [&free_](GramBuf b) { free_.push_back(b); };
  const auto gemm = [&p](GramGemm kind, GramBuf a, GramBuf b, float alpha, GramBuf c, float beta, GramBuf d) {
    p.ops.push_back({GramOpKind::kGemm, kind, a, b, c, d, alpha, beta});
  };
  // W' = Q W (or the final output): operand order as the column-major plan reads it.
  const auto apply = [&](GramBuf q, GramBuf x, GramBuf d) {
    GramBuf qx = q;
    if (x_bf16) {
      p.ops.push_back(
          {GramOpKind::kRound, GramGemm::kSquare, q, GramBuf::kNone, GramBuf::kNone, GramBuf::kQx, 1.f, 0.f});
      qx = GramBuf::kQx;
    }
    if (transpose) gemm(GramGemm::kApply, qx, x, 1.f, d, 0.f, d);
    else gemm(GramGemm::kApply, x, qx, 1.f, d, 0.f, d);
  };

  std::size_t wi = 0;
  GramBuf R = take();
  gemm(GramGemm::kGram, w[0], w[0], 1.f, R, 0.f, R);
  GramBuf Q = GramBuf::kNone;
  const std::size_t steps = schedule.size();
  for (std::size_t k = 0; k < steps; ++k) {
    const NsCoefficients& co = schedule[k];
    if (k > 0 && restart[k]) {
      apply(Q, w[wi], w[wi + 1]);
      ++wi;
      give(Q);
      Q = GramBuf::kNone;
      gemm(GramGemm::kGram, w[wi], w[wi], 1.f, R, 0.f, R);
    }
    // P = a I + b R + c R^2, formed explicitly: near convergence its eigenvalues are small
    // differences of large terms (a + b + c is 0.12 for quintic's first row), and folding a I into
    // the later products' epilogues (R Z + a R) would cancel in those products' rounding instead
    // of in one exact-as-possible diagonal addition.
    const GramBuf P = take();
    gemm(GramGemm::kSquare, R, R, co.c, R, co.b, P);
    p.ops.push_back(
        {GramOpKind::kAddDiag, GramGemm::kSquare, GramBuf::kNone, GramBuf::kNone, GramBuf::kNone, P, co.a, 0.f});
    const bool last_in_segment = k + 1 == steps || restart[k + 1];
    if (!last_in_segment) {
      // R <- P R P as P (R P); every factor is a polynomial in the segment's first R.
      const GramBuf T = take();
      gemm(GramGemm::kSquare, R, P, 1.f, T, 0.f, T);
      gemm(GramGemm::kSquare, P, T, 1.f, R, 0.f, R);
      give(T);
    }
    if (Q == GramBuf::kNone) {
      Q = P;  // first step of a segment: Q = P
    } else {
      const GramBuf next = take();
      gemm(GramGemm::kSquare, Q, P, 1.f, next, 0.f, next);
      give(Q);
      give(P);
      Q = next;
    }
  }
  apply(Q, w[wi], GramBuf::kOut);

  for (bool& u : p.uses) u = false;
  p.uses[gram_buf_index(p.x_first)] = true;
  for (const GramOp& op : p.ops) {
    for (GramBuf b : {op.a, op.b, op.c, op.d}) {
      if (b != GramBuf::kNone) p.uses[gram_buf_index(b)] = true;
    }
  }
  return p;
}

// Element type of a buffer: the W buffers and kQx hold the W type, everything else fp32.
inline bool gram_buf_is_bf16(const GramProgram& p, GramBuf b) {
  return p.x_bf16 && (b == GramBuf::kX0 || b == GramBuf::kX1 || b == GramBuf::kQx);
}

// Byte offsets of the buffers a program needs inside one scratch allocation (kOut is the
// caller's output, unused buffers have none), each 256-byte aligned, followed by the per-matrix
// norm scratch. (The BLAS workspace is allocated per algorithm, see blas_context.h.)
constexpr std::size_t kNoOffset = static_cast<std::size_t>(-1);

struct GramScratchLayout {
  std::size_t offset[kGramBufCount];
  std::size_t sum_squares;    // batch floats
  std::size_t norm_partials;  // norm_partial_slots floats
  std::size_t total;
};

inline GramScratchLayout gram_scratch_layout(const GramProgram& p, int64_t batch, int64_t m, int64_t n,
                                             int64_t norm_partial_slots) {
  // s x s buffers use the padded leading dimension of make_ns_gemm_plan (16-byte aligned rows).
  const std::size_t square = static_cast<std::size_t>(padded_square_ld(p.gram_side) * p.gram_side);
  GramScratchLayout layout{};
  std::size_t at = 0;
  for (int i = 0; i < kGramBufCount; ++i) {
    const GramBuf b = static_cast<GramBuf>(i);
    layout.offset[i] = kNoOffset;
    if (b == GramBuf::kNone || b == GramBuf::kOut || !p.uses[i]) continue;
    const bool w = b == GramBuf::kX0 || b == GramBuf::kX1;
    const std::size_t elems = static_cast<std::size_t>(batch) * (w ? static_cast<std::size_t>(m * n) : square);
    layout.offset[i] = at;
    at += ns_align256(elems * (gram_buf_is_bf16(p, b) ? 2 : 4));
  }
  return end_with_norm_scratch(layout, at, batch, norm_partial_slots);
}

// FLOPs of one matrix (2 per multiply-add), by kind of product: with the long side and a
// symmetric result (W W^T), with the long side and a general result (Q W, B W), and s x s (every
// s x s product of both iterations has a symmetric result).
struct NsFlops {
  double long_symmetric;
  double long_general;
  double square;
};

inline NsFlops gram_program_flops(const GramProgram& p) {
  const double s = static_cast<double>(p.gram_side), l = static_cast<double>(p.long_side);
  NsFlops f{0.0, 0.0, 0.0};
  for (const GramOp& op : p.ops) {
    if (op.kind != GramOpKind::kGemm) continue;
    if (op.gemm == GramGemm::kSquare) f.square += 2.0 * s * s * s;
    else if (op.gemm == GramGemm::kGram) f.long_symmetric += 2.0 * s * s * l;
    else f.long_general += 2.0 * s * s * l;
  }
  return f;
}

// The standard iteration (§4.1) per step: A = W W^T, A A, and B W.
inline NsFlops standard_flops(int64_t m, int64_t n, bool transpose, std::size_t steps) {
  const double s = static_cast<double>(transpose ? n : m), l = static_cast<double>(transpose ? m : n);
  const double k = static_cast<double>(steps);
  return {k * 2.0 * s * s * l, k * 2.0 * s * s * l, k * 2.0 * s * s * s};
}

}  // namespace megatron_eopt
