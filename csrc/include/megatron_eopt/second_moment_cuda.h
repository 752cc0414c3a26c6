// Host launchers of the second-moment normalizations on CUDA (AdaMuon, NorMuon, NAMO; docs/design.md
// §4.7). Raw pointers and a stream only: the torch glue owns checks, allocation and devices.
// Each call enqueues a fixed number of kernels per list (per 32 tensors), with no host
// synchronisation and no host-to-device copies (tensor descriptors travel in kernel arguments).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "megatron_eopt/second_moment_math.h"
#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

// Each launcher reads beta2, eps (and NAMO's grad_scale) from `scalars` inside its kernels, and
// its kernels return at once when scalars.found_inf is set.

// One list entry. All tensors are contiguous and on the current device.
struct Moment2Tensor {
  float* update;   // (rows, cols) fp32, the raw Newton–Schulz output; normalized in place
  float* moment2;  // fp32 state: (rows, cols) adamuon; rows (rows >= cols) or cols entries normuon; 1 namo
  int64_t rows;
  int64_t cols;
  const void* grad = nullptr;      // NAMO: the gradient, rows * cols elements of grad_type
  const void* ns_input = nullptr;  // NAMO: the Newton–Schulz input, rows * cols elements of ns_input_type
  StorageType grad_type = StorageType::kFloat32;
  StorageType ns_input_type = StorageType::kFloat32;
};

// v <- lerp(v, O^2, 1 - beta2); O <- O / (sqrt(v) + eps). One kernel.
void adamuon_normalize_cuda(const std::vector<Moment2Tensor>& list, const Moment2Scalars& scalars, cudaStream_t stream);

// Floats of device scratch normuon_normalize_cuda needs (0 for an empty list).
std::size_t normuon_scratch_floats(const std::vector<Moment2Tensor>& list);
// Per slice (row if rows >= cols, else column): v <- lerp(v, mean(O^2), 1 - beta2);
// U' = O rsqrt(max(v, eps)); O <- U' ||O||_F / max(||U'||_F, eps). Two kernels.
void normuon_normalize_cuda(const std::vector<Moment2Tensor>& list, const Moment2Scalars& scalars, float* scratch,
                            cudaStream_t stream);

// Floats of device scratch namo_normalize_cuda needs (0 for an empty list).
std::size_t namo_scratch_floats(const std::vector<Moment2Tensor>& list);
// v <- lerp(v, ||grad||_F^2, 1 - beta2); O <- O ||ns_input||_F / (sqrt(v) + eps). Three kernels.
void namo_normalize_cuda(const std::vector<Moment2Tensor>& list, const Moment2Scalars& scalars, float* scratch,
                         cudaStream_t stream);

}  // namespace megatron_eopt
