#include "ops/stable.h"

#include <stdexcept>

namespace megatron_eopt {

const char* device_type_name(DeviceType type) {
  switch (type) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::CUDA: return "cuda";
    case DeviceType::Meta: return "meta";
    default: return "device";
  }
}

namespace detail {

void append(std::ostringstream& os, const Device& d) {
  os << device_type_name(d.type());
  if (d.has_index()) os << ':' << static_cast<int>(d.index());
}

void append(std::ostringstream& os, IntList values) {
  os << '[';
  for (std::size_t i = 0; i < values.size(); ++i) os << (i ? ", " : "") << values[i];
  os << ']';
}

}  // namespace detail

void raise_error(ErrorKind kind, const std::string& message) {
  throw std::runtime_error((kind == ErrorKind::kType ? "TypeError: " : "ValueError: ") + message);
}

}  // namespace megatron_eopt
