// Element storage types of the kernels (foreach, second-moment, Newton–Schulz) and their fp32
// conversions, usable on the host and on the device alike, so the CPU and CUDA kernels round
// identically. bf16 is handled as raw bits (round to nearest even, NaN kept quiet), the same rule
// as c10::BFloat16 and __float2bfloat16_rn.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#endif

#include "megatron_eopt/host_device.h"

namespace megatron_eopt {

// bf16 as stored in memory: the high 16 bits of an fp32.
struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2, "Bf16 must be layout-compatible with a 16-bit bf16");

// Element type of a tensor a kernel reads. The foreach ops store fp32 and bf16 only; the
// second-moment ops also read fp16 inputs (NAMO's gradient and Newton–Schulz input).
enum class StorageType : uint8_t { kFloat32, kBFloat16, kFloat16 };

MEGATRON_EOPT_HD uint32_t float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

MEGATRON_EOPT_HD float bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

MEGATRON_EOPT_HD float to_float(float v) { return v; }
MEGATRON_EOPT_HD float to_float(Bf16 v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }
#ifdef __CUDACC__
// fp16 through CUDA's own conversion: only CUDA kernels read it here (the CPU ones use c10::Half).
MEGATRON_EOPT_HD float to_float(__half v) { return __half2float(v); }
#endif

template <typename T>
MEGATRON_EOPT_HD T from_float(float v);

template <>
MEGATRON_EOPT_HD float from_float<float>(float v) {
  return v;
}

template <>
MEGATRON_EOPT_HD Bf16 from_float<Bf16>(float v) {
  // NaN is picked with a bit mask rather than a branch or a select, which compilers turn into
  // control flow that stops CPU loops from vectorizing.
  const uint32_t u = float_bits(v);
  const uint32_t rounding_bias = ((u >> 16) & 1u) + 0x7FFFu;
  const uint32_t rounded = (u + rounding_bias) >> 16;
  const uint32_t nan_mask = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  return Bf16{static_cast<uint16_t>((rounded & ~nan_mask) | (0x7FC0u & nan_mask))};
}

// The fp32 value v takes once stored as T (the reference rounds there too).
template <typename T>
MEGATRON_EOPT_HD float round_to(float v) {
  return to_float(from_float<T>(v));
}

// The wider of two storage types: the dtype torch's type promotion would compute in.
template <typename A, typename B>
struct Wider {
  using type = float;
};
template <>
struct Wider<Bf16, Bf16> {
  using type = Bf16;
};

template <typename T>
struct StorageOf;
template <>
struct StorageOf<float> {
  static constexpr StorageType value = StorageType::kFloat32;
};
template <>
struct StorageOf<Bf16> {
  static constexpr StorageType value = StorageType::kBFloat16;
};

}  // namespace megatron_eopt
