#include "cpu/cpu_product_plan.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <vector>

#include "cpu/batched_gemm.h"
#include "cpu/cpu_bf16_products.h"
#include "cpu/env_choice.h"
#include "megatron_eopt/ns_algorithm.h"
#include "ops/aten_ops.h"
#include "ops/c_export.h"

namespace megatron_eopt {
namespace {

// The order of CpuSymmetricProducts.
std::atomic<int> g_symmetric{
    env_choice("MEGATRON_EOPT_CPU_SYMMETRIC_PRODUCTS", {"auto", "kernel", "gemm", "panels", "full"})};

// Size classes by the symmetric side: below 384, 384 to 1535, from 1536 on. Where a product's
// fastest route lies can move with its size (on an AMX Xeon, ATen's bf16 X X^T at 2048 measured
// 14.4 ms in row panels against 9.2 for one full GEMM in one run, 14.6 against 21.8 in another,
// while the 768 probe preferred the panels), so the largest matrices are decided on a probe of
// their own size rather than by the 768 one. Its X is square, not twice as wide as tall, to keep
// its cost down (1.2-1.3 s, once per process, on that 2-core Xeon).
constexpr int kClasses = 3;
constexpr int64_t kClassUpperSides[kClasses - 1] = {384, 1536};
constexpr int64_t kProbeSides[kClasses] = {256, 768, 1536};
constexpr int64_t kProbeDepths[kClasses] = {512, 1536, 1536};
// Rounds of the candidates after a warm-up run of each: every round runs each candidate once, in
// turn, and each keeps its best time. Interleaved, a burst of other load on the machine slows
// whichever candidate it meets, and the other rounds still see that candidate unhindered.
constexpr int kRounds = 5;

using Candidate = std::function<void()>;

// The best time of each candidate (seconds).
std::vector<double> best_seconds(const std::vector<Candidate>& candidates) {
  for (const Candidate& run : candidates) run();
  std::vector<double> best(candidates.size(), 0.0);
  for (int round = 0; round < kRounds; ++round) {
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      candidates[i]();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best[i] = round == 0 ? s : std::min(best[i], s);
    }
  }
  return best;
}

// Values in [-1, 1) from a fixed sequence: timing only, no denormals, no zeros.
Tensor probe_values(const std::vector<int64_t>& sizes) {
  Tensor t = aten::empty(sizes, kFloat, Device(kCPU));
  float* p = t.mutable_data_ptr<float>();
  uint32_t state = 12345u;
  for (int64_t i = 0; i < t.numel(); ++i) {
    state = state * 1664525u + 1013904223u;
    p[i] = static_cast<float>(state >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return t;
}

CpuProductPlan measure(int size_class) {
  const int64_t s = kProbeSides[size_class], d = kProbeDepths[size_class];
  const int64_t blocks = ns_symmetric_blocks(s, NsDevice::kCpu);
  CpuProductSeconds t{};
  const auto run_type = [&](ScalarType type, double& general, double& full, double& panels, double& kernel,
                            bool kernel_runs) {
    Tensor x = probe_values({1, s, d}), p = probe_values({1, s, s});
    if (type == kBFloat16) {
      x = aten::to_dtype(x, kBFloat16);
      p = aten::to_dtype(p, kBFloat16);
    }
    Tensor out = aten::empty({1, s, d}, type, x.device());
    Tensor g = aten::empty({1, s, s}, type, x.device());
    const Tensor xt = aten::mT(x);
    std::vector<Candidate> candidates{[&] { gemm_out(out, p, x); }, [&] { symmetric_gemm_out(g, x, xt, 1); }};
    if (blocks > 1) candidates.emplace_back([&] { symmetric_gemm_out(g, x, xt, blocks); });
    if (kernel_runs) candidates.emplace_back([&] { symmetric_kernel_out(g, x); });
    const std::vector<double> best = best_seconds(candidates);
    general = best[0];
    full = best[1];
    if (blocks > 1) panels = best[2];
    if (kernel_runs) kernel = best.back();
  };
  run_type(kFloat, t.fp32_general, t.fp32_full, t.fp32_panels, t.fp32_kernel, syrk_available(SyrkType::kFp32));
  // ATen's bf16 GEMMs are a scalar fallback on CPUs without bf16 instructions (hundreds of times
  // slower): not a candidate there, and not worth timing.
  if (cpu_has_bf16_instructions()) {
    run_type(kBFloat16, t.bf16_general, t.bf16_full, t.bf16_panels, t.bf16_kernel, syrk_available(SyrkType::kBf16));
  }
  return CpuProductPlan{s, d, t, choose_cpu_products(t)};
}

}  // namespace

void set_cpu_symmetric_products(CpuSymmetricProducts mode) { g_symmetric.store(static_cast<int>(mode)); }

CpuSymmetricProducts cpu_symmetric_products_setting() { return static_cast<CpuSymmetricProducts>(g_symmetric.load()); }

int cpu_product_class(int64_t side) {
  int c = 0;
  while (c < kClasses - 1 && side >= kClassUpperSides[c]) ++c;
  return c;
}

const CpuProductPlan& cpu_product_plan(int64_t side) {
  static std::once_flag once[kClasses];
  static CpuProductPlan plans[kClasses];
  const int c = cpu_product_class(side);
  std::call_once(once[c], [c] { plans[c] = measure(c); });
  return plans[c];
}

bool cpu_symmetric_on_kernel(SyrkType type, int64_t side, NsProducts products) {
  if (!syrk_available(type) || products == NsProducts::kFull) return false;
  if (products == NsProducts::kSymmetric) return true;
  switch (cpu_symmetric_products_setting()) {
    case CpuSymmetricProducts::kKernel: return true;
    case CpuSymmetricProducts::kGemm:
    case CpuSymmetricProducts::kPanels:
    case CpuSymmetricProducts::kFull: return false;
    case CpuSymmetricProducts::kAuto: break;
  }
  const CpuProductChoice& choice = cpu_product_plan(side).choice;
  return type == SyrkType::kBf16 ? choice.kernel_bf16 : choice.kernel_fp32;
}

int64_t cpu_symmetric_gemm_blocks(SyrkType type, int64_t side, int64_t blocks, NsProducts products) {
  if (blocks <= 1 || products == NsProducts::kFull) return 1;
  if (products == NsProducts::kSymmetric) return blocks;
  const CpuSymmetricProducts setting = cpu_symmetric_products_setting();
  if (setting == CpuSymmetricProducts::kPanels) return blocks;
  if (setting == CpuSymmetricProducts::kFull) return 1;
  const CpuProductChoice& choice = cpu_product_plan(side).choice;
  return (type == SyrkType::kBf16 ? choice.panels_bf16 : choice.panels_fp32) ? blocks : 1;
}

bool cpu_uses_bf16_gemms(int64_t side) {
  switch (cpu_bf16_products()) {
    case CpuBf16Products::kBf16: return true;
    case CpuBf16Products::kFp32: return false;
    case CpuBf16Products::kAuto: break;
  }
  return cpu_has_bf16_instructions() && cpu_product_plan(side).choice.bf16_gemms;
}

double cpu_bf16_speedup(int64_t side) {
  if (!cpu_uses_bf16_gemms(side)) return 1.0;
  const CpuProductChoice& choice = cpu_product_plan(side).choice;
  // Forced bf16 GEMMs where the measurement chose fp32 ones: the measured ratio (below 1) still
  // says the Gram iteration's fp32 products are no slower; without bf16 instructions nothing was
  // timed, and the fallback GEMMs are far slower than fp32 ones.
  return choice.bf16_gemms ? choice.bf16_speedup : 1.0;
}

CpuIteration cpu_iteration(NsPrecision requested, int64_t side) {
  const NsPrecision precision = cpu_iteration_precision(requested, side);
  return {precision, precision == NsPrecision::kMedium ? cpu_bf16_speedup(side) : 1.0};
}

void gram_product_out(Tensor& d, const Tensor& x, int64_t blocks, NsProducts products) {
  const SyrkType type = d.scalar_type() == kBFloat16 ? SyrkType::kBf16 : SyrkType::kFp32;
  gram_product_out(d, x, cpu_symmetric_on_kernel(type, x.size(1), products) ? Tensor() : aten::mT(x), blocks, products);
}

void gram_product_out(Tensor& d, const Tensor& x, const Tensor& xt, int64_t blocks, NsProducts products) {
  const SyrkType type = d.scalar_type() == kBFloat16 ? SyrkType::kBf16 : SyrkType::kFp32;
  if (cpu_symmetric_on_kernel(type, x.size(1), products)) symmetric_kernel_out(d, x);
  else symmetric_gemm_out(d, x, xt, cpu_symmetric_gemm_blocks(type, x.size(1), blocks, products));
}

}  // namespace megatron_eopt

// ctypes entry points of megatron_eopt.set_cpu_symmetric_products / cpu_product_plan.
// Modes: 0 auto, 1 kernel, 2 gemm, 3 panels, 4 full (anything else is refused with -1).
MEGATRON_EOPT_C_EXPORT int megatron_eopt_set_cpu_symmetric_products(int mode) {
  if (mode < 0 || mode > 4) return -1;
  megatron_eopt::set_cpu_symmetric_products(static_cast<megatron_eopt::CpuSymmetricProducts>(mode));
  return 0;
}

MEGATRON_EOPT_C_EXPORT int megatron_eopt_cpu_symmetric_products_setting() {
  return static_cast<int>(megatron_eopt::cpu_symmetric_products_setting());
}

// The entries of megatron_eopt_cpu_product_plan's arrays, comma-separated and in order (which: 0
// seconds, 1 choices, 2 in_use): the caller sizes and names its arrays from these, so the layout
// is written once, here.
namespace {
constexpr const char* kPlanFields[3] = {
    "fp32_general,fp32_full,fp32_panels,fp32_kernel,bf16_general,bf16_full,bf16_panels,bf16_kernel",
    "symmetric_fp32,symmetric_bf16,medium,gemm_fp32,gemm_bf16",
    "symmetric_fp32,symmetric_bf16,medium",
};
constexpr int kPlanSizes[3] = {8, 5, 3};
}  // namespace

MEGATRON_EOPT_C_EXPORT const char* megatron_eopt_cpu_product_plan_fields(int which) {
  return which >= 0 && which < 3 ? kPlanFields[which] : "";
}

// The measured plan of the class of `side` (measuring it on first use): the probe X's shape,
// seconds as in CpuProductSeconds, choices = measured kernel_fp32, kernel_bf16, bf16_gemms,
// panels_fp32, panels_bf16; in_use = the first three with the settings applied; the bf16 speedup
// in use (the fields above, and their counts in `sizes`, which must match). Returns 0, or -1 when
// the measurement failed or the sizes do not match (message in `error`, up to error_size bytes).
MEGATRON_EOPT_C_EXPORT int megatron_eopt_cpu_product_plan(int64_t side, int64_t* probe_side, int64_t* probe_depth,
                                                          double* seconds, int* choices, int* in_use,
                                                          const int64_t* sizes, double* speedup, char* error,
                                                          int64_t error_size) {
  using namespace megatron_eopt;
  try {
    for (int i = 0; i < 3; ++i) {
      if (sizes[i] != kPlanSizes[i])
        throw std::invalid_argument("cpu_product_plan: array sizes do not match its fields");
    }
    const CpuProductPlan& plan = cpu_product_plan(side);
    *probe_side = plan.probe_side;
    *probe_depth = plan.probe_depth;
    const CpuProductSeconds& t = plan.seconds;
    const double values[kPlanSizes[0]] = {t.fp32_general, t.fp32_full, t.fp32_panels, t.fp32_kernel,
                                          t.bf16_general, t.bf16_full, t.bf16_panels, t.bf16_kernel};
    std::copy(values, values + kPlanSizes[0], seconds);
    const CpuProductChoice& c = plan.choice;
    choices[0] = c.kernel_fp32, choices[1] = c.kernel_bf16, choices[2] = c.bf16_gemms;
    choices[3] = c.panels_fp32, choices[4] = c.panels_bf16;
    in_use[0] = cpu_symmetric_on_kernel(SyrkType::kFp32, side);
    in_use[1] = cpu_symmetric_on_kernel(SyrkType::kBf16, side);
    in_use[2] = cpu_uses_bf16_gemms(side);
    *speedup = cpu_bf16_speedup(side);
    return 0;
  } catch (const std::exception& e) {
    if (error_size > 0) {
      std::strncpy(error, e.what(), static_cast<std::size_t>(error_size - 1));
      error[error_size - 1] = '\0';
    }
    return -1;
  }
}
