#include "cpu/cpu_bf16_products.h"

#include <atomic>
#include <cstdint>

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "cpu/env_choice.h"
#include "ops/c_export.h"

namespace megatron_eopt {
namespace {

// The order of CpuBf16Products.
std::atomic<int> g_mode{env_choice("MEGATRON_EOPT_CPU_BF16_PRODUCTS", {"auto", "bf16", "fp32"})};

#if defined(__aarch64__) && defined(__linux__)
constexpr unsigned long kHwcap2Bf16 = 1ul << 14;  // HWCAP2_BF16 of the kernel's asm/hwcap.h
#endif

#if defined(__x86_64__)
uint64_t enabled_state() {  // XCR0: the register state the OS saves, hence enables
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool detect() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || (c & (1u << 27)) == 0) return false;  // no OSXSAVE: no xgetbv
  const uint64_t state = enabled_state();
  const bool avx512_state = (state & 0xE6) == 0xE6;             // XMM, YMM, opmask, ZMM halves
  const bool tile_state = (state & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool avx512f = (b & (1u << 16)) != 0, amx_bf16 = (d & (1u << 22)) != 0;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool avx512_bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5)) != 0;
  return (avx512f && avx512_bf16 && avx512_state) || (amx_bf16 && tile_state);
}
#elif defined(__aarch64__) && defined(__linux__)
bool detect() { return (getauxval(AT_HWCAP2) & kHwcap2Bf16) != 0; }  // the BF16 extension (BFMMLA)
#else
bool detect() { return false; }  // unknown: fp32 GEMMs of bf16 values are never the slow path
#endif

}  // namespace

bool cpu_has_bf16_instructions() {
  static const bool has = detect();
  return has;
}

void set_cpu_bf16_products(CpuBf16Products mode) { g_mode.store(static_cast<int>(mode)); }

CpuBf16Products cpu_bf16_products() { return static_cast<CpuBf16Products>(g_mode.load()); }

}  // namespace megatron_eopt

// ctypes entry points of megatron_eopt.set_cpu_bf16_products / cpu_bf16_products: mode 0 auto,
// 1 bf16, 2 fp32 (anything else is refused with -1).
MEGATRON_EOPT_C_EXPORT int megatron_eopt_set_cpu_bf16_products(int mode) {
  if (mode < 0 || mode > 2) return -1;
  megatron_eopt::set_cpu_bf16_products(static_cast<megatron_eopt::CpuBf16Products>(mode));
  return 0;
}

// The setting (0 auto, 1 bf16, 2 fp32), and whether the CPU has bf16 instructions (0 or 1).
MEGATRON_EOPT_C_EXPORT void megatron_eopt_cpu_bf16_products(int* mode, int* instructions) {
  *mode = static_cast<int>(megatron_eopt::cpu_bf16_products());
  *instructions = megatron_eopt::cpu_has_bf16_instructions() ? 1 : 0;
}
