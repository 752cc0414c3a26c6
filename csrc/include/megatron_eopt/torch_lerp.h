// torch.lerp for a scalar weight, shared by every op whose reference state update is a lerp_
// (momentum EMA, second-moment EMA), so the CPU and CUDA backends match torch to the bit.
#pragma once

#include <math.h>

#include <cmath>

#include "megatron_eopt/host_device.h"

namespace megatron_eopt {

// torch.lerp(start, end, weight) for a scalar weight: the two formulas torch switches between at
// |weight| = 0.5, each as the single fma torch's CPU (vectorized) and CUDA kernels evaluate.
// Every operand is computed unconditionally and only selected (no branch, nothing for the
// compiler to speculate), so CPU loops over it vectorize.
MEGATRON_EOPT_HD float torch_lerp(float start, float end, float weight) {
  const bool small = fabsf(weight) < 0.5f;
  const float weight_minus_one = weight - 1.f;
  const float coefficient = small ? weight : weight_minus_one;
  const float base = small ? start : end;
  return fmaf(coefficient, end - start, base);
}

}  // namespace megatron_eopt
