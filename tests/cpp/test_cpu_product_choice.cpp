// The CPU product plan's decisions (cpu_product_choice.h) on timings shaped like each CPU class.
#include <gtest/gtest.h>

#include "megatron_eopt/cpu_product_choice.h"

namespace megatron_eopt {
namespace {

// fp32: general, full, panels, kernel; bf16: the same. Milliseconds of a 768 x 1536 probe.
TEST(CpuProductChoice, AmxTakesAtenBf16GemmsAndKeepsTheFp32Kernel) {
  // An AMX Xeon: bf16 GEMMs 4-6x fp32, the kernel's bf16 dot products far behind them.
  const CpuProductChoice c = choose_cpu_products({6.0, 5.8, 4.5, 4.0, 1.0, 1.8, 1.1, 6.0});
  EXPECT_TRUE(c.kernel_fp32);
  EXPECT_FALSE(c.kernel_bf16);
  EXPECT_TRUE(c.panels_bf16);
  EXPECT_TRUE(c.bf16_gemms);
  EXPECT_DOUBLE_EQ(c.bf16_speedup, (6.0 + 2 * 4.0) / (1.0 + 2 * 1.1));
}

TEST(CpuProductChoice, AmxLargeProbeTakesOneFullBf16Gemm) {
  // Timings of the 1536 x 1536 probe where ATen's bf16 GEMM on tiles runs one full product faster
  // than the panels (as one run at 2048 measured), while fp32 still gains from the panels' fewer
  // FLOPs: the two types choose their routes independently.
  const CpuProductChoice c = choose_cpu_products({24.8, 24.0, 16.5, 30.0, 3.5, 3.2, 4.2, 20.0});
  EXPECT_FALSE(c.kernel_fp32);
  EXPECT_TRUE(c.panels_fp32);
  EXPECT_FALSE(c.kernel_bf16);
  EXPECT_FALSE(c.panels_bf16);
  EXPECT_TRUE(c.bf16_gemms);
  EXPECT_DOUBLE_EQ(c.bf16_speedup, (24.8 + 2 * 16.5) / (3.5 + 2 * 3.2));
}

TEST(CpuProductChoice, Avx512Bf16TakesTheKernelForBf16) {
  // An AVX512-BF16 CPU without AMX: bf16 GEMMs about 2x fp32, the kernel half the FLOPs at the same rate.
  const CpuProductChoice c = choose_cpu_products({6.0, 6.0, 4.6, 3.2, 3.0, 3.0, 2.4, 1.6});
  EXPECT_TRUE(c.kernel_fp32);
  EXPECT_TRUE(c.kernel_bf16);
  EXPECT_TRUE(c.bf16_gemms);
  EXPECT_DOUBLE_EQ(c.bf16_speedup, (6.0 + 2 * 3.2) / (3.0 + 2 * 1.6));
}

TEST(CpuProductChoice, Avx2KeepsFp32ProductsAndPanels) {
  // No AVX-512, no bf16 instructions: nothing of the kernel or bf16 was timed.
  const CpuProductChoice c = choose_cpu_products({9.0, 9.0, 7.0, 0, 0, 0, 0, 0});
  EXPECT_FALSE(c.kernel_fp32);
  EXPECT_FALSE(c.kernel_bf16);
  EXPECT_TRUE(c.panels_fp32);
  EXPECT_FALSE(c.bf16_gemms);
  EXPECT_DOUBLE_EQ(c.bf16_speedup, 1.0);
}

TEST(CpuProductChoice, SlowBf16GemmsAreNotTaken) {
  // bf16 GEMMs slower than fp32 ones (a weak bf16 unit): "medium" keeps fp32 products.
  const CpuProductChoice c = choose_cpu_products({1.0, 1.0, 0, 0, 1.5, 1.5, 0, 0});
  EXPECT_FALSE(c.bf16_gemms);
  EXPECT_DOUBLE_EQ(c.bf16_speedup, 1.0);
  EXPECT_FALSE(c.panels_fp32);  // one panel: not timed
}

TEST(CpuProductChoice, TiesKeepAtenFullGemmsAndFp32) {
  const CpuProductChoice c = choose_cpu_products({1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0});
  EXPECT_FALSE(c.kernel_fp32);
  EXPECT_FALSE(c.panels_fp32);
  EXPECT_FALSE(c.kernel_bf16);
  EXPECT_FALSE(c.panels_bf16);
  EXPECT_FALSE(c.bf16_gemms);
}

TEST(CpuProductChoice, TheKernelMustBeatTheFasterAtenRoute) {
  // Faster than one full GEMM but not than the panels: ATen's panels.
  const CpuProductChoice c = choose_cpu_products({2.0, 2.0, 1.2, 1.5, 0, 0, 0, 0});
  EXPECT_TRUE(c.panels_fp32);
  EXPECT_FALSE(c.kernel_fp32);
}

}  // namespace
}  // namespace megatron_eopt
