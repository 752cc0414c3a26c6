// Which code computes the CPU Newton–Schulz products, decided by measurement on the running CPU.
//
// CPU classes differ by an order of magnitude in what is fast: on an AVX2-only CPU ATen's bf16
// GEMMs are a scalar fallback, on an AVX512-BF16 CPU they run dot-product instructions, on an AMX
// CPU tiles several times faster again; our symmetric kernel (syrk_cpu.h) halves the products'
// FLOPs but runs on AVX-512 FMAs or AVX512-BF16 dot products only, never on AMX. No rule read off
// one machine holds on the others, so the first Newton–Schulz call of a size class times the
// candidates on a probe of that class (a few milliseconds to over a second) and the process keeps
// the choice:
//   - symmetric products X X^T (W W^T, G G, R, R R) in fp32 and in bf16: the kernel, or ATen's
//     GEMMs on the lower column panels (batched_gemm.h);
//   - "medium"'s bf16 products: ATen's bf16 GEMMs, or fp32 GEMMs of the same bf16 values;
//   - how much faster the standard iteration's products are than the Gram iteration's under
//     "medium" (the Gram iteration keeps fp32 products of bf16 values): the weight of
//     gram_flop_weight in the algorithm choice.
// Process-wide settings (set_cpu_symmetric_products, set_cpu_bf16_products, or the environment
// variables MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS = auto | kernel | gemm | panels | full and
// MEGATRON_EOPT_CPU_BF16_PRODUCTS = auto | bf16 | fp32 read at load) override the measurement,
// e.g. to pin a reproducible path or to force the portable one (gemm: ATen's GEMMs only; panels /
// full: one of its two forms).
#pragma once

#include <cstdint>

#include "cpu/syrk_cpu.h"
#include "megatron_eopt/ns_precision.h"
#include "megatron_eopt/ns_products.h"
#include "ops/aten_ops.h"
#include "megatron_eopt/cpu_product_choice.h"

namespace megatron_eopt {

// kGemm: ATen's GEMMs, as the lower column panels or one full GEMM, whichever measured faster;
// kPanels / kFull pin one of those two.
enum class CpuSymmetricProducts { kAuto = 0, kKernel = 1, kGemm = 2, kPanels = 3, kFull = 4 };

void set_cpu_symmetric_products(CpuSymmetricProducts mode);
CpuSymmetricProducts cpu_symmetric_products_setting();

// The measurement of one size class: probe X of probe_side x probe_depth, the candidates' times
// and the choices made from them (cpu_product_choice.h).
struct CpuProductPlan {
  int64_t probe_side, probe_depth;
  CpuProductSeconds seconds;
  CpuProductChoice choice;  // as measured, before the settings
};

// Size classes: symmetric sides below 384, 384 to 1535, and from 1536 on (probes of side 256, 768
// and 1536).
int cpu_product_class(int64_t side);

// The measured plan of the class of `side`, measured on first use and then kept.
const CpuProductPlan& cpu_product_plan(int64_t side);

// What runs, the settings applied: whether X X^T of side `side` in `type` runs on the symmetric
// kernel, and otherwise in how many column panels (`blocks` from ns_symmetric_blocks, or 1 where one
// full GEMM measured faster); whether "medium" runs ATen's bf16 GEMMs; the Gram weight that goes
// with it. A call's `products` overrides the measurement and the process-wide setting: symmetric
// takes the kernel where this CPU has it, else the panels; full one GEMM.
bool cpu_symmetric_on_kernel(SyrkType type, int64_t side, NsProducts products = NsProducts::kAuto);
int64_t cpu_symmetric_gemm_blocks(SyrkType type, int64_t side, int64_t blocks, NsProducts products = NsProducts::kAuto);
bool cpu_uses_bf16_gemms(int64_t side);
double cpu_bf16_speedup(int64_t side);

// The CPU Newton–Schulz's precision for a Gram side `side` (cpu_iteration_precision: "medium" of a
// tiny side runs in fp32) and the speed-up of its "medium" products that weighs the algorithm
// choice (1 outside "medium"): what run_newton_schulz_cpu runs, and what the ns_plan ABI reports.
struct CpuIteration {
  NsPrecision precision;
  double bf16_speedup;
};
CpuIteration cpu_iteration(NsPrecision requested, int64_t side);

// d = x . x^T for x (batch, s, k) with any strides (a transposed view included), d and x both
// fp32 or both bf16: the Gram products W W^T, W^T W, G G (G symmetric) and R R. On the symmetric
// kernel of syrk_cpu.h (symmetric_kernel_out) where this plan runs it (measured on this CPU, or
// set), otherwise symmetric_gemm_out of batched_gemm.h with `blocks` column panels. The plan
// dispatches here: batched_gemm.h holds the products it measures and knows nothing of it.
void gram_product_out(Tensor& d, const Tensor& x, int64_t blocks, NsProducts products = NsProducts::kAuto);
// The same with x^T given (a view the caller keeps across calls: each view made is a dispatcher
// call, which shows on small matrices).
void gram_product_out(Tensor& d, const Tensor& x, const Tensor& xt, int64_t blocks,
                      NsProducts products = NsProducts::kAuto);

}  // namespace megatron_eopt
