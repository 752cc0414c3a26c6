// A per-step hyper-parameter as the ops read it: the storage of a 0-dim fp32 or fp64 tensor on the
// op's device (host memory for the CPU kernels, device memory for the CUDA kernels), read where it
// is used. A value that changes between steps then needs neither a host sync nor a new CUDA graph,
// and an fp64 value (what the optimizers keep) gives the same rounding as the reference's Python
// floats, e.g. float(1 - momentum).
#pragma once

#include "megatron_eopt/host_device.h"

namespace megatron_eopt {

struct StepScalar {
  const void* ptr = nullptr;  // nullptr: an optional argument that was not given
  bool is_double = false;

  MEGATRON_EOPT_HD bool present() const { return ptr != nullptr; }
  MEGATRON_EOPT_HD double load() const {
    return is_double ? *static_cast<const double*>(ptr) : static_cast<double>(*static_cast<const float*>(ptr));
  }
  // The value, or `fallback` when the argument was not given.
  MEGATRON_EOPT_HD double load_or(double fallback) const { return present() ? load() : fallback; }
};

// GradScaler's found_inf: any non-zero value means the step must leave every tensor as it was.
MEGATRON_EOPT_HD bool step_skipped(const StepScalar& found_inf) {
  return found_inf.present() && found_inf.load() != 0.0;
}

}  // namespace megatron_eopt
