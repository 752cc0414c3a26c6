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
// "medium" stores W, G and P in bf16 with `bf16_gemms` (ATen's bf16 GEMMs), else in fp32 rounded
// to bf16 values after each product (cpu/cpu_bf16_products.h); other precisions ignore it.
void standard_newton_schulz_cpu(const Tensor& w, Tensor& out, const NsOptions& opts, bool bf16_gemms);

}  // namespace megatron_eopt
