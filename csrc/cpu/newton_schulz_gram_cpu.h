// CPU executor of the Gram Newton–Schulz program (DESIGN §11).
#pragma once

#include <ATen/core/Tensor.h>

#include "megatron_eopt/ns_gram_plan.h"
#include "torch/newton_schulz_args.h"

namespace megatron_eopt {

// w: (batch, m, n) fp32 CPU tensor (any strides); returns the contiguous fp32 (batch, m, n)
// result of `program`, built for opts' shape, transpose and precision.
at::Tensor gram_newton_schulz_cpu(const at::Tensor& w, const NsOptions& opts, const GramProgram& program);

}  // namespace megatron_eopt
