// The initial value of a process-wide CPU setting from the environment.
#pragma once

#include <cstdlib>
#include <cstring>
#include <initializer_list>

namespace megatron_eopt {

// The index of environment variable `name`'s value among `values`; 0 (the first, "auto") where it
// is unset or names none of them (the Python loader refuses such a value at import, naming it).
inline int env_choice(const char* name, std::initializer_list<const char*> values) {
  const char* v = std::getenv(name);
  if (v == nullptr) return 0;
  int index = 0;
  for (const char* value : values) {
    if (std::strcmp(v, value) == 0) return index;
    ++index;
  }
  return 0;
}

}  // namespace megatron_eopt
