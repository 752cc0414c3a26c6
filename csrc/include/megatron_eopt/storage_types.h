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

// IEEE fp16 as stored in memory. Converted by hand on the host (the CPU kernels include no CUDA
// header) with the same round-to-nearest-even rule as c10::Half and __float2half_rn.
struct Fp16 {
  uint16_t bits;
};
static_assert(sizeof(Fp16) == 2, "Fp16 must be layout-compatible with a 16-bit half");

// Element type of a tensor a kernel reads or writes.
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
MEGATRON_EOPT_HD float to_float(Fp16 v) {
#ifdef __CUDA_ARCH__
  return __half2float(__ushort_as_half(v.bits));
#else
  // Exact widening: normals rebias the exponent, subnormals are mantissa * 2^-24.
  const uint32_t h = v.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_float(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;  // 2^-24, exact
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

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

template <>
MEGATRON_EOPT_HD Fp16 from_float<Fp16>(float v) {
#ifdef __CUDA_ARCH__
  return Fp16{__half_as_ushort(__float2half_rn(v))};
#else
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return Fp16{static_cast<uint16_t>(sign | 0x7E00u)};   // NaN: quiet, as c10
  if (magnitude >= 0x477FF000u) return Fp16{static_cast<uint16_t>(sign | 0x7C00u)};  // >= 65520 rounds to inf
  if (magnitude < 0x38800000u) {
    // Below 2^-14 (fp16 subnormals): adding 0.5 makes fp32's own rounding round to a multiple of
    // 2^-24, and the low bits of the sum are the fp16 mantissa (1024 carries into the exponent).
    const float sum = bits_float(magnitude) + 0.5f;
    return Fp16{static_cast<uint16_t>(sign | (float_bits(sum) - 0x3F000000u))};
  }
  // Normal: rebias the exponent (127 - 15 = 112) and round the 13 dropped bits to nearest even.
  const uint32_t odd = (magnitude >> 13) & 1u;
  return Fp16{static_cast<uint16_t>(sign | ((magnitude + 0xC8000FFFu + odd) >> 13))};
#endif
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
template <>
struct Wider<Fp16, Fp16> {
  using type = Fp16;
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
template <>
struct StorageOf<Fp16> {
  static constexpr StorageType value = StorageType::kFloat16;
};

}  // namespace megatron_eopt
