// The libraries are built with hidden visibility (only the op registrations run, nothing is
// linked against them); the plain C functions read with ctypes are exported explicitly.
#pragma once

#define MEGATRON_EOPT_C_EXPORT extern "C" __attribute__((visibility("default")))
