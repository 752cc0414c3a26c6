// The ATen operators the glue calls, through the stable dispatcher entry point
// (torch_call_dispatcher): tensor creation, views, copies and the BLAS products of the CPU
// Newton–Schulz. Each is the ATen overload of the same name; `*_out` write into `out`.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "ops/stable.h"

namespace megatron_eopt::aten {

namespace detail {
// Runs operator `name`.`overload` on the boxed arguments and returns its (first) result.
template <typename... Args>
Tensor call(const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, sizeof...(Args)> stack{torch::stable::detail::from(args)...};
  MEGATRON_EOPT_SHIM_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<Tensor>(stack[0]);
}
}  // namespace detail

// Contiguous, uninitialized.
inline Tensor empty(const std::vector<int64_t>& sizes, ScalarType dtype, const Device& device) {
  return torch::stable::empty(IntList(sizes), dtype, std::nullopt, device);
}
inline std::vector<int64_t> sizes_of(const Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end());
}
inline std::vector<int64_t> strides_of(const Tensor& t) {
  return std::vector<int64_t>(t.strides().begin(), t.strides().end());
}
inline Tensor empty_like(const Tensor& t) { return aten::empty(aten::sizes_of(t), t.scalar_type(), t.device()); }
inline Tensor contiguous(const Tensor& t) { return torch::stable::contiguous(t); }
inline Tensor clone(const Tensor& t) { return torch::stable::clone(t); }
inline void copy_(Tensor& dst, const Tensor& src) { torch::stable::copy_(dst, src); }
inline Tensor to_dtype(const Tensor& t, ScalarType dtype) { return torch::stable::to(t, dtype); }

// ---- views ----
inline Tensor select(const Tensor& t, int64_t dim, int64_t index) { return torch::stable::select(t, dim, index); }
inline Tensor narrow(const Tensor& t, int64_t dim, int64_t start, int64_t length) {
  return detail::call("aten::narrow", "", t, dim, start, length);
}
inline Tensor transpose(const Tensor& t, int64_t dim0, int64_t dim1) { return torch::stable::transpose(t, dim0, dim1); }
inline Tensor mT(const Tensor& t) { return aten::transpose(t, -2, -1); }
// The same storage (and version counter) outside autograd: what an in-place op writes through, so
// that its BLAS out= calls accept a tensor that requires grad.
inline Tensor detach(const Tensor& t) { return detail::call("aten::detach", "", t); }
inline Tensor view(const Tensor& t, const std::vector<int64_t>& sizes) {
  return torch::stable::view(t, IntList(sizes));
}
// The same storage read as `dtype` (the last dimension scaled by the ratio of element sizes).
inline Tensor view_dtype(const Tensor& t, ScalarType dtype) { return detail::call("aten::view", "dtype", t, dtype); }
inline Tensor reshape(const Tensor& t, const std::vector<int64_t>& sizes) {
  return torch::stable::reshape(t, IntList(sizes));
}
inline Tensor unsqueeze(const Tensor& t, int64_t dim) { return torch::stable::unsqueeze(t, dim); }
inline Tensor squeeze(const Tensor& t, int64_t dim) { return torch::stable::squeeze(t, dim); }
inline Tensor stack(const TensorList& tensors, int64_t dim) { return detail::call("aten::stack", "", tensors, dim); }

// ---- arithmetic ----
// Scalar arguments cannot cross the stable dispatcher interface (torch 2.14 converts none), so a
// factor travels as a 0-dim float64 CPU tensor: TensorIterator reads such a "CPU scalar" in the
// op's compute type, exactly as it reads a Python number, on every device.
inline Tensor scalar_tensor(double value) {
  Tensor t = aten::empty({}, kDouble, Device(kCPU));
  torch::stable::fill_(t, value);
  return t;
}
inline void mul_(Tensor& t, double factor) { (void)detail::call("aten::mul_", "Tensor", t, scalar_tensor(factor)); }
inline void mul_out(Tensor& out, const Tensor& t, double factor) {
  (void)detail::call("aten::mul", "out", t, scalar_tensor(factor), out);
}
inline void div_out(Tensor& out, const Tensor& a, const Tensor& b) {
  (void)detail::call("aten::div", "out", a, b, out);
}
inline Tensor div(const Tensor& a, const Tensor& b) { return detail::call("aten::div", "Tensor", a, b); }
// The Frobenius norm of each matrix of a (batch, m, n) stack, kept as (batch, 1, 1): ATen's
// vector 2-norm over the last two dims (norm.ScalarOpt_dim with p = None, i.e. 2).
inline Tensor matrix_norms(const Tensor& t) {
  const std::vector<int64_t> dims{-2, -1};
  return detail::call("aten::norm", "ScalarOpt_dim", t, std::nullopt, IntList(dims), true);
}

// ---- products ----
inline void mm_out(Tensor& out, const Tensor& a, const Tensor& b) { (void)detail::call("aten::mm", "out", a, b, out); }
inline void bmm_out(Tensor& out, const Tensor& a, const Tensor& b) {
  (void)detail::call("aten::bmm", "out", a, b, out);
}

}  // namespace megatron_eopt::aten
