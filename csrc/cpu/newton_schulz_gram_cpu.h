// CPU executors of the two Newton–Schulz algorithms (docs/design.md §4.1 and §4.4).
#pragma once

#include "megatron_eopt/ns_gram_plan.h"
#include "ops/newton_schulz_args.h"

namespace megatron_eopt {

// w: (batch, m, n) fp32 CPU tensor (any strides); out: contiguous fp32 (batch, m, n), written
// with the result of `program` (built for opts' shape, transpose and precision).
void gram_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts, const GramProgram& program);

// The same for the standard iteration: G = W W^T; B = c G G + b G; W = B W + a W per step, in the
// compute dtype ("high" has no TF32 on a CPU and runs in fp32, like "highest").
void standard_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts);

}  // namespace megatron_eopt
