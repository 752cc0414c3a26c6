#include "ops/newton_schulz_args.h"

#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

namespace megatron_eopt {

NsOptions parse_ns_options(const Tensor& x, const std::vector<double>& coefficients, int64_t steps, bool repeat_last,
                           double eps, std::optional<bool> transpose, const std::string& precision,
                           const std::string& algorithm, const std::string& eps_mode, double norm_divisor,
                           bool row_equilibration, bool frobenius_renorm, const std::string& products) {
  MEGATRON_EOPT_CHECK_TYPE(x.scalar_type() == kFloat, "newton_schulz: x must be float32, got ", x.scalar_type());
  MEGATRON_EOPT_CHECK_VALUE(x.dim() == 2 || x.dim() == 3,
                            "newton_schulz: x must be 2-D (m, n) or 3-D (batch, m, n), got ", x.dim(), "-D");
  MEGATRON_EOPT_CHECK_VALUE(steps >= 1, "newton_schulz: steps must be at least 1, got ", steps);
  // The kernels use eps in fp32: below ~1e-45 it would become 0 (NaN on a zero input), above 3.4e38 inf.
  MEGATRON_EOPT_CHECK_VALUE(std::isfinite(static_cast<float>(eps)) && static_cast<float>(eps) > 0.f,
                            "newton_schulz: eps must be finite and positive in float32, got ", eps);
  NsOptions opts{};
  try {
    opts.schedule = expand_schedule(std::vector<double>(coefficients.begin(), coefficients.end()), steps,
                                    repeat_last ? SchedulePolicy::kRepeatLast : SchedulePolicy::kCycle);
    opts.precision = parse_ns_precision(std::string(precision.data(), precision.size()));
    opts.algorithm = parse_ns_algorithm(std::string(algorithm.data(), algorithm.size()));
    opts.recipe = make_ns_recipe(eps_mode, norm_divisor, row_equilibration, frobenius_renorm);
    opts.products = parse_ns_products(std::string(products.data(), products.size()));
  } catch (const std::invalid_argument& e) {
    MEGATRON_EOPT_CHECK_VALUE(false, "newton_schulz: ", e.what());
  }
  opts.eps = static_cast<float>(eps);
  opts.batch = x.dim() == 3 ? x.size(0) : 1;
  opts.rows = x.size(-2);
  opts.cols = x.size(-1);
  opts.transpose = transpose.value_or(opts.rows > opts.cols);
  return opts;
}

namespace {

// Everything the choice depends on. The schedule's rows are compared as floats: equal rows, equal choice.
struct ChoiceKey {
  int algorithm, precision, device;
  double cpu_bf16_speedup;
  int64_t rows, cols;
  bool transpose;
  std::vector<float> schedule;
  bool operator<(const ChoiceKey& o) const {
    return std::tie(algorithm, precision, device, cpu_bf16_speedup, rows, cols, transpose, schedule) <
           std::tie(o.algorithm, o.precision, o.device, o.cpu_bf16_speedup, o.rows, o.cols, o.transpose, o.schedule);
  }
};

// Past this many distinct problems the cache starts over (a bound on memory, not expected in training).
constexpr std::size_t kMaxCachedChoices = 4096;

}  // namespace

NsAlgorithmChoice resolve_ns_algorithm(const NsOptions& opts, NsDevice device, double cpu_bf16_speedup) {
  if (opts.algorithm == NsAlgorithm::kStandard) return {NsAlgorithm::kStandard, {}};
  // The choice and the Gram program (the schedule's peak, restarts, program) cost more host time
  // than a small matrix's iteration: made once per problem and kept for the process.
  ChoiceKey key{static_cast<int>(opts.algorithm),
                static_cast<int>(opts.precision),
                static_cast<int>(device),
                cpu_bf16_speedup,
                opts.rows,
                opts.cols,
                opts.transpose,
                {}};
  key.schedule.reserve(opts.schedule.size() * 3);
  for (const NsCoefficients& k : opts.schedule) key.schedule.insert(key.schedule.end(), {k.a, k.b, k.c});
  static auto* const mutex = new std::mutex;  // leaked: no destruction order to get wrong at exit
  static auto* const cache = new std::map<ChoiceKey, NsAlgorithmChoice>;
  {
    const std::lock_guard<std::mutex> lock(*mutex);
    const auto it = cache->find(key);
    if (it != cache->end()) return it->second;
  }
  NsAlgorithmChoice choice = choose_ns_algorithm(opts.algorithm, opts.rows, opts.cols, opts.transpose, opts.schedule,
                                                 opts.precision, device, cpu_bf16_speedup);
  const std::lock_guard<std::mutex> lock(*mutex);
  if (cache->size() >= kMaxCachedChoices) cache->clear();
  cache->emplace(std::move(key), choice);
  return choice;
}

}  // namespace megatron_eopt
