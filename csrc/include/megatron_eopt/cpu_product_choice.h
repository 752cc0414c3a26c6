// The CPU product plan's decisions from its probe times (cpu/cpu_product_plan.h measures them):
// torch-free, so GoogleTest checks the rules on made-up timings of every CPU class.
#pragma once

#include <algorithm>

namespace megatron_eopt {

// Seconds of one probe product of each candidate (the best of a few runs; 0: not run, because the
// candidate cannot run on this CPU or is not a candidate there). "general": a square matrix times
// X; "full", "panels", "kernel": X X^T as one ATen GEMM, as ATen GEMMs on its lower column panels, on
// the symmetric kernel.
struct CpuProductSeconds {
  double fp32_general, fp32_full, fp32_panels, fp32_kernel;
  double bf16_general, bf16_full, bf16_panels, bf16_kernel;
};

struct CpuProductChoice {
  bool kernel_fp32;     // fp32 X X^T on the kernel
  bool kernel_bf16;     // bf16 X X^T on the kernel
  bool panels_fp32;     // on ATen's GEMMs, the column panels rather than one full GEMM (fp32)
  bool panels_bf16;     // the same for bf16
  bool bf16_gemms;      // "medium" on ATen's bf16 GEMMs rather than fp32 GEMMs of bf16 values
  double bf16_speedup;  // fp32 step products' time / bf16's where bf16_gemms, else 1
};

// Strictly faster wins; a tie keeps ATen's route, one full GEMM and fp32 products (the choices that
// need nothing of this CPU). A standard step is modelled as one general and two symmetric products,
// each on its faster route. Without bf16 timings (no bf16 instructions) "medium" keeps fp32.
inline CpuProductChoice choose_cpu_products(const CpuProductSeconds& t) {
  CpuProductChoice c{false, false, false, false, false, 1.0};
  const auto gemm = [](double full, double panels) { return panels > 0 && panels < full ? panels : full; };
  const auto symmetric = [&](double full, double panels, double kernel) {
    const double aten = gemm(full, panels);
    return kernel > 0 && kernel < aten ? kernel : aten;
  };
  c.panels_fp32 = t.fp32_panels > 0 && t.fp32_panels < t.fp32_full;
  c.kernel_fp32 = t.fp32_kernel > 0 && t.fp32_kernel < gemm(t.fp32_full, t.fp32_panels);
  if (t.bf16_general <= 0 || t.bf16_full <= 0) return c;
  c.panels_bf16 = t.bf16_panels > 0 && t.bf16_panels < t.bf16_full;
  c.kernel_bf16 = t.bf16_kernel > 0 && t.bf16_kernel < gemm(t.bf16_full, t.bf16_panels);
  const double fp32_step = t.fp32_general + 2 * symmetric(t.fp32_full, t.fp32_panels, t.fp32_kernel);
  const double bf16_step = t.bf16_general + 2 * symmetric(t.bf16_full, t.bf16_panels, t.bf16_kernel);
  c.bf16_gemms = bf16_step < fp32_step;
  if (c.bf16_gemms) c.bf16_speedup = fp32_step / bf16_step;
  return c;
}

}  // namespace megatron_eopt
