// Newton–Schulz coefficient schedules: expanding a table of (a, b, c) rows to one row per step.
// Torch-free so the kernels, the glue and the GoogleTest suite share one definition.
#pragma once

#include <cmath>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace megatron_eopt {

// One Newton–Schulz step maps each singular value s to a*s + b*s^3 + c*s^5.
struct NsCoefficients {
  float a;
  float b;
  float c;
};

// How a schedule runs past the end of its table: `kCycle` starts over from the first row
// (simple, quintic, aol, custom); `kRepeatLast` keeps using the last row (polar_express, cans,
// deepseekv4), whose polynomials are tuned to converge once the spectrum is already near 1.
enum class SchedulePolicy { kCycle, kRepeatLast };

// `flat_rows` holds the table row-major: a0, b0, c0, a1, b1, c1, ...
inline std::vector<NsCoefficients> expand_schedule(const std::vector<double>& flat_rows, long steps,
                                                   SchedulePolicy policy) {
  if (flat_rows.empty() || flat_rows.size() % 3 != 0) {
    throw std::invalid_argument("coefficients must hold one or more (a, b, c) rows, got " +
                                std::to_string(flat_rows.size()) + " values");
  }
  if (steps < 1) {
    throw std::invalid_argument("steps must be at least 1, got " + std::to_string(steps));
  }
  for (double v : flat_rows) {
    if (!std::isfinite(v)) throw std::invalid_argument("coefficients must be finite");
  }
  const std::size_t rows = flat_rows.size() / 3;
  std::vector<NsCoefficients> out;
  out.reserve(static_cast<std::size_t>(steps));
  for (long i = 0; i < steps; ++i) {
    const std::size_t r = policy == SchedulePolicy::kCycle
                              ? static_cast<std::size_t>(i) % rows
                              : (static_cast<std::size_t>(i) < rows ? static_cast<std::size_t>(i) : rows - 1);
    out.push_back({static_cast<float>(flat_rows[3 * r]), static_cast<float>(flat_rows[3 * r + 1]),
                   static_cast<float>(flat_rows[3 * r + 2])});
  }
  return out;
}

}  // namespace megatron_eopt
