// Muon update scale factors, from the (rows, cols) shape of the orthogonalized update.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace megatron_eopt {

enum class ScaleMode { kSpectral, kShapeScaling, kUnitRmsNorm };

inline ScaleMode parse_scale_mode(const std::string& name) {
  if (name == "spectral") return ScaleMode::kSpectral;
  if (name == "shape_scaling") return ScaleMode::kShapeScaling;
  if (name == "unit_rms_norm") return ScaleMode::kUnitRmsNorm;
  throw std::invalid_argument("scale_mode must be one of spectral, shape_scaling, unit_rms_norm; got '" + name + "'");
}

//   spectral:      sqrt(max(m, n))     (learning rate transfers from AdamW)
//   shape_scaling: sqrt(max(1, m / n)) (the original Muon scale)
//   unit_rms_norm: sqrt(m / n)
inline double muon_scale_factor(int64_t rows, int64_t cols, ScaleMode mode) {
  const double m = static_cast<double>(rows);
  const double n = static_cast<double>(cols);
  switch (mode) {
    case ScaleMode::kSpectral: return std::sqrt(std::max(m, n));
    case ScaleMode::kShapeScaling: return std::sqrt(std::max(1.0, m / n));
    case ScaleMode::kUnitRmsNorm: return std::sqrt(m / n);
  }
  return 1.0;
}

}  // namespace megatron_eopt
