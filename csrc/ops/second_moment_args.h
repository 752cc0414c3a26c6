// Argument checks and in-place plumbing shared by the CPU and CUDA second-moment normalizations
// (adamuon_normalize_, normuon_normalize_, namo_normalize_).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "ops/stable.h"

#include "megatron_eopt/second_moment_math.h"

namespace megatron_eopt {

const char* moment2_op_name(Moment2Method method);

// Shape of the fp32 moment2 state of a (rows, cols) update, as Emerging-Optimizers' AdaptiveMuon
// creates it: (rows, cols) adamuon; (rows, 1) normuon when rows >= cols, else (1, cols); (1,) namo.
std::vector<int64_t> moment2_shape(Moment2Method method, int64_t rows, int64_t cols);

// beta2, eps and found_inf as 0-dim fp32 / fp64 tensors on `device`; on the CPU their values are
// checked too (beta2 finite in [0, 1], eps finite and positive in fp32).
Moment2Scalars moment2_scalars(const char* op, const Tensor& beta2, const Tensor& eps,
                               const std::optional<Tensor>& found_inf, const std::optional<Device>& device,
                               DeviceType backend);

// Every check, before anything is written: list lengths, dtypes (updates and moment2 fp32; grads and
// ns_inputs fp32, bf16 or fp16), ranks, shapes, one device for all, and the per-step scalars:
// 0-dim fp32 / fp64 tensors on that device (on the CPU also their values: beta2 in [0, 1], eps
// finite and positive in fp32; device values are the caller's to check, reading them would sync).
// `grads` / `ns_inputs` / `grad_scale` are only checked for NAMO. Failures name the argument.
Moment2Scalars check_moment2_args(Moment2Method method, const TensorList& updates, const TensorList& moment2,
                                  const TensorList& grads, const TensorList& ns_inputs, const Tensor& beta2,
                                  const Tensor& eps, const std::optional<Tensor>& grad_scale,
                                  const std::optional<Tensor>& found_inf, DeviceType backend);

// Contiguous working tensors of an in-place list argument: the originals where they are contiguous,
// copies otherwise; write_back() copies the results into the non-contiguous originals.
class InPlaceList {
 public:
  explicit InPlaceList(const TensorList& targets);
  const Tensor& operator[](std::size_t i) const { return work_[i]; }
  void write_back() const;

 private:
  std::vector<Tensor> targets_;
  std::vector<Tensor> work_;
  std::vector<bool> copied_;  // work_[i] is a contiguous copy of a non-contiguous targets_[i]
};

}  // namespace megatron_eopt
