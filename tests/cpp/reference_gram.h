// The tests' Gram program runner: runs a GramProgram (ns_gram_plan.h) op by op as the executors
// do, every GEMM through its column-major GemmShape of make_ns_gemm_plan and the reference GEMM,
// with each operand's storage given by the caller. Separate buffers per name check a program's
// arithmetic; one shared array checks a placement (ns_gram_placement.h): a value overwritten
// while still live changes the result.
#pragma once

#include <cstdint>

#include "megatron_eopt/ns_gemm_plan.h"
#include "megatron_eopt/ns_gram_plan.h"
#include "reference_gemm.h"

namespace megatron_eopt::testing {

// where(op_index, operand, buf) -> double*: the storage of operand 0..3 (a, b, c, d) of op
// op_index, which names buffer `buf`. The normalized input must already be where the caller's
// storage of program.x_first is. C is passed only when beta != 0 (a BLAS does not read it then).
template <class Where>
void run_gram_program(const GramProgram& program, const NsGemmPlan& plan, int64_t batch, Where where) {
  const int64_t s = plan.gram, ld = plan.square_ld;
  for (std::size_t i = 0; i < program.ops.size(); ++i) {
    const GramOp& op = program.ops[i];
    double* d = where(i, 3, op.d);
    if (op.kind == GramOpKind::kAddDiag) {
      for (int64_t t = 0; t < batch; ++t)
        for (int64_t k = 0; k < s; ++k) d[t * plan.square_stride + k * ld + k] += op.alpha;
    } else if (op.kind == GramOpKind::kRound) {
      // Exact arithmetic: rounding to bf16 is the identity here; only the matrices' entries move.
      const double* a = where(i, 0, op.a);
      for (int64_t t = 0; t < batch; ++t)
        for (int64_t c = 0; c < s; ++c)
          for (int64_t r = 0; r < s; ++r)
            d[t * plan.square_stride + c * ld + r] = a[t * plan.square_stride + c * ld + r];
    } else {
      const GemmShape& shape = op.gemm == GramGemm::kGram    ? plan.gram_gemm
                               : op.gemm == GramGemm::kApply ? plan.update_gemm
                                                             : plan.poly_gemm;
      reference_gemm(shape, batch, op.alpha, where(i, 0, op.a), where(i, 1, op.b), op.beta,
                     op.beta != 0.f ? where(i, 2, op.c) : nullptr, d);
    }
  }
}

}  // namespace megatron_eopt::testing
