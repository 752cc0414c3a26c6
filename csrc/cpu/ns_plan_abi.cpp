// The Newton–Schulz algorithm choice (ns_algorithm.h) as a plain C function, for the Python code
// that runs the iteration itself around collectives (tensor-parallel "distributed" mode): it
// follows the same choice and restarts as the fused op. Read with ctypes; no op, no tensors. It
// lives with the CPU backend: on the CPU the choice takes the iteration's precision and "medium"
// speed-up from the measured product plan (cpu_iteration, as run_newton_schulz_cpu does).
#include <cstdint>
#include <exception>
#include <vector>

#include "cpu/cpu_product_plan.h"
#include "megatron_eopt/ns_algorithm.h"

#include "ops/c_export.h"

// coefficients: `values` doubles, (a, b, c) rows; precision 0 medium, 1 high, 2 highest;
// algorithm 0 auto, 1 standard, 2 gram; device 0 CPU, 1 CUDA. Writes restart[k] (0 or 1) for the
// `steps` steps and returns 1 for the Gram iteration, 0 for the standard one, -1 on bad input.
MEGATRON_EOPT_C_EXPORT int megatron_eopt_ns_plan(const double* coefficients, int64_t values, int64_t steps,
                                                 int repeat_last, int64_t m, int64_t n, int transpose, int precision,
                                                 int algorithm, int device, int8_t* restart) {
  using namespace megatron_eopt;
  try {
    if (precision < 0 || precision > 2 || algorithm < 0 || algorithm > 2 || device < 0 || device > 1) return -1;
    const auto schedule = expand_schedule(std::vector<double>(coefficients, coefficients + values), steps,
                                          repeat_last ? SchedulePolicy::kRepeatLast : SchedulePolicy::kCycle);
    NsPrecision p = precision == 0 ? NsPrecision::kMedium : precision == 1 ? NsPrecision::kHigh : NsPrecision::kHighest;
    const NsAlgorithm a = algorithm == 0   ? NsAlgorithm::kAuto
                          : algorithm == 1 ? NsAlgorithm::kStandard
                                           : NsAlgorithm::kGram;
    const NsDevice d = device == 1 ? NsDevice::kCuda : NsDevice::kCpu;
    double speedup = 1.0;
    if (d == NsDevice::kCpu) {
      const CpuIteration iteration = cpu_iteration(p, transpose != 0 ? n : m);
      p = iteration.precision;
      speedup = iteration.bf16_speedup;
    }
    const NsAlgorithmChoice choice = choose_ns_algorithm(a, m, n, transpose != 0, schedule, p, d, speedup);
    const std::vector<bool> r = gram_restarts(schedule, gram_arithmetic(p, d));
    for (std::size_t k = 0; k < r.size(); ++k) restart[k] = r[k] ? 1 : 0;
    return choice.algorithm == NsAlgorithm::kGram ? 1 : 0;
  } catch (const std::exception&) {
    return -1;
  }
}
