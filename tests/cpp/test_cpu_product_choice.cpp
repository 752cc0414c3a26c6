// The CPU product plan's decisions (cpu_product_choice.h) on timings shaped like each CPU class.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "megatron_eopt/cpu_product_choice.h"

namespace megatron_eopt {
namespace {

constexpr double kUnchecked = std::numeric_limits<double>::quiet_NaN();

// The routes a plan chooses (CpuProductChoice's flags, in its order).
struct Routes {
  bool kernel_fp32, kernel_bf16, panels_fp32, panels_bf16, bf16_gemms;
};

// One CPU class: its probe timings (fp32: general, full, panels, kernel; bf16: the same;
// milliseconds of a 768 x 1536 probe, 0 where not timed), the routes the plan must choose and
// its bf16_speedup (kUnchecked: not part of the case).
struct ChoiceCase {
  const char* cpu;
  CpuProductSeconds seconds;
  Routes routes;
  double bf16_speedup;
};

const ChoiceCase kCases[] = {
    // An AMX Xeon: bf16 GEMMs 4-6x fp32, the kernel's bf16 dot products far behind them.
    {"amx",
     {6.0, 5.8, 4.5, 4.0, 1.0, 1.8, 1.1, 6.0},
     {true, false, true, true, true},
     (6.0 + 2 * 4.0) / (1.0 + 2 * 1.1)},
    // The 1536 x 1536 probe where ATen's bf16 GEMM on tiles runs one full product faster than the
    // panels (as one run at 2048 measured), while fp32 still gains from the panels' fewer FLOPs: the
    // two types choose their routes independently.
    {"amx_large_probe",
     {24.8, 24.0, 16.5, 30.0, 3.5, 3.2, 4.2, 20.0},
     {false, false, true, false, true},
     (24.8 + 2 * 16.5) / (3.5 + 2 * 3.2)},
    // AVX512-BF16 without AMX: bf16 GEMMs about 2x fp32, the kernel half the FLOPs at the same rate.
    {"avx512_bf16",
     {6.0, 6.0, 4.6, 3.2, 3.0, 3.0, 2.4, 1.6},
     {true, true, true, true, true},
     (6.0 + 2 * 3.2) / (3.0 + 2 * 1.6)},
    // No AVX-512, no bf16 instructions: nothing of the kernel or bf16 was timed.
    {"avx2", {9.0, 9.0, 7.0, 0, 0, 0, 0, 0}, {false, false, true, false, false}, 1.0},
    // bf16 GEMMs slower than fp32 ones (a weak bf16 unit): "medium" keeps fp32 products; one panel,
    // so the panels were not timed.
    {"slow_bf16", {1.0, 1.0, 0, 0, 1.5, 1.5, 0, 0}, {false, false, false, false, false}, 1.0},
    // Ties keep ATen's full GEMMs and fp32.
    {"ties", {1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0}, {false, false, false, false, false}, kUnchecked},
    // The kernel faster than one full GEMM but not than the panels: ATen's panels.
    {"kernel_behind_panels", {2.0, 2.0, 1.2, 1.5, 0, 0, 0, 0}, {false, false, true, false, false}, kUnchecked},
};

TEST(CpuProductChoice, EachCpuClassGetsItsRoutes) {
  for (const ChoiceCase& expected : kCases) {
    SCOPED_TRACE(expected.cpu);
    const CpuProductChoice c = choose_cpu_products(expected.seconds);
    EXPECT_EQ(c.kernel_fp32, expected.routes.kernel_fp32);
    EXPECT_EQ(c.kernel_bf16, expected.routes.kernel_bf16);
    EXPECT_EQ(c.panels_fp32, expected.routes.panels_fp32);
    EXPECT_EQ(c.panels_bf16, expected.routes.panels_bf16);
    EXPECT_EQ(c.bf16_gemms, expected.routes.bf16_gemms);
    if (!std::isnan(expected.bf16_speedup)) EXPECT_DOUBLE_EQ(c.bf16_speedup, expected.bf16_speedup);
  }
}

}  // namespace
}  // namespace megatron_eopt
