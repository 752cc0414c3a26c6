// What the op glue uses of torch: only the LibTorch stable ABI (torch/csrc/stable, the C shim
// underneath), compiled with TORCH_TARGET_VERSION set to the oldest torch the wheel supports, so
// one build loads on that torch and every later one. This header names the types the glue works
// with, formats messages and raises the op errors.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "megatron_eopt/storage_types.h"

namespace megatron_eopt {

using Tensor = torch::stable::Tensor;
using TensorList = std::vector<Tensor>;
using ScalarType = torch::headeronly::ScalarType;
using Device = torch::stable::Device;
using DeviceType = torch::headeronly::DeviceType;
using IntList = torch::headeronly::IntHeaderOnlyArrayRef;

constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kByte = ScalarType::Byte;
constexpr DeviceType kCPU = DeviceType::CPU;
constexpr DeviceType kCUDA = DeviceType::CUDA;

// The kernels' element type of a float32, bfloat16 or float16 dtype (the ops' checks admit no other).
inline StorageType storage_type(ScalarType t) {
  switch (t) {
    case ScalarType::BFloat16: return StorageType::kBFloat16;
    case ScalarType::Half: return StorageType::kFloat16;
    default: return StorageType::kFloat32;
  }
}

// Element-wise equality of two size (or stride) lists; torch 2.11's headers define no operator==
// for IntHeaderOnlyArrayRef.
inline bool same_values(IntList a, IntList b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// ---- messages ----
// "cpu" / "cuda", as torch names device types.
const char* device_type_name(DeviceType type);

namespace detail {
inline void append(std::ostringstream& os, ScalarType t) { os << torch::headeronly::toString(t); }
void append(std::ostringstream& os, const Device& d);  // "cpu", "cuda:0", as torch prints devices
void append(std::ostringstream& os, IntList values);   // "[2, 3]", as torch prints sizes
inline void append(std::ostringstream& os, const std::vector<int64_t>& values) { append(os, IntList(values)); }
template <typename T>
void append(std::ostringstream& os, const T& value) {
  os << value;
}
}  // namespace detail

// The pieces of a message, concatenated with the formats torch uses for dtypes, devices and sizes.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (detail::append(os, args), ...);
  return os.str();
}

// ---- errors ----
// Checks a C shim call's status and throws on failure. Torch 2.13+ headers name the macro
// STABLE_TORCH_ERROR_CODE_CHECK (it carries the failed call's message where the running torch
// provides it); 2.11 and 2.12 headers have only TORCH_ERROR_CODE_CHECK.
#ifdef STABLE_TORCH_ERROR_CODE_CHECK
#define MEGATRON_EOPT_SHIM_CHECK(call) STABLE_TORCH_ERROR_CODE_CHECK(call)
#else
#define MEGATRON_EOPT_SHIM_CHECK(call) TORCH_ERROR_CODE_CHECK(call)
#endif

// The stable ABI carries one exception type across the library boundary, std::runtime_error,
// which Python sees as RuntimeError. The kind of error (ValueError or TypeError, as the Python
// front raises for the same mistake) leads the message: "ValueError: newton_schulz: ...", and
// megatron_eopt's op wrappers re-raise it as that Python type (megatron_eopt/_errors.py).
enum class ErrorKind { kValue, kType };
[[noreturn]] void raise_error(ErrorKind kind, const std::string& message);

}  // namespace megatron_eopt

// Checks whose failure is the caller's mistake: a bad value (ValueError) or a bad type
// (TypeError). The message pieces are only formatted on failure.
#define MEGATRON_EOPT_CHECK_VALUE(cond, ...)                                                                          \
  do {                                                                                                                \
    if (!(cond)) ::megatron_eopt::raise_error(::megatron_eopt::ErrorKind::kValue, ::megatron_eopt::cat(__VA_ARGS__)); \
  } while (0)
#define MEGATRON_EOPT_CHECK_TYPE(cond, ...)                                                                          \
  do {                                                                                                               \
    if (!(cond)) ::megatron_eopt::raise_error(::megatron_eopt::ErrorKind::kType, ::megatron_eopt::cat(__VA_ARGS__)); \
  } while (0)
