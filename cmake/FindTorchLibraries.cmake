# Locates the torch installed in the build's Python (torch.utils.cmake_prefix_path) and exposes
# its headers and libraries as the interface targets `torch_libraries` and `torch_cuda_libraries`.
# The extension uses the LibTorch stable ABI only: its C symbols (aoti_torch_*, torch_*) live in
# libtorch_cpu and, for the CUDA ones, libtorch_cuda; no C++ symbol of torch is linked.
# TorchConfig.cmake is not used: for a CUDA build of torch it insists on a full CUDA toolkit
# (cuDNN, cuBLAS in the toolkit), which neither a CPU-only machine nor a pip-provided toolkit has.
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import os, torch, torch.utils; print(os.path.dirname(os.path.dirname(torch.utils.cmake_prefix_path))); print(int(torch.compiled_with_cxx11_abi())); print(int(torch.version.cuda is not None)); print(torch.__version__)"
  OUTPUT_VARIABLE _torch_info
  OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _torch_rc)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "megatron_eopt: cannot import torch from ${Python_EXECUTABLE}; build with --no-build-isolation against an installed torch")
endif()
string(REPLACE "\n" ";" _torch_info "${_torch_info}")
list(GET _torch_info 0 TORCH_ROOT)
list(GET _torch_info 1 TORCH_CXX11_ABI)
list(GET _torch_info 2 TORCH_HAS_CUDA)
list(GET _torch_info 3 TORCH_VERSION)
message(STATUS "megatron_eopt: torch ${TORCH_VERSION} at ${TORCH_ROOT}")

add_library(torch_libraries INTERFACE)
target_include_directories(torch_libraries SYSTEM INTERFACE
  ${TORCH_ROOT}/include ${TORCH_ROOT}/include/torch/csrc/api/include)
# TORCH_TARGET_VERSION: the stable-ABI version the code is compiled for (the oldest torch it
# loads on); the headers reject any API newer than that at compile time.
string(REPLACE "." ";" _target_parts "${MEGATRON_EOPT_TORCH_FLOOR}")
list(GET _target_parts 0 _target_major)
list(GET _target_parts 1 _target_minor)
math(EXPR TORCH_TARGET_VERSION_HEX "(${_target_major} << 8) | ${_target_minor}" OUTPUT_FORMAT HEXADECIMAL)
string(REPLACE "0x" "" _target_hex "${TORCH_TARGET_VERSION_HEX}")
string(LENGTH "${_target_hex}" _target_len)
if(_target_len EQUAL 3)  # 2.11 -> 0x20b -> "020b": one byte each for major and minor
  set(_target_hex "0${_target_hex}")
endif()
target_compile_definitions(torch_libraries INTERFACE _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI}
  TORCH_TARGET_VERSION=0x${_target_hex}000000000000ULL
  MEGATRON_EOPT_TORCH_FLOOR="${MEGATRON_EOPT_TORCH_FLOOR}")
target_link_directories(torch_libraries INTERFACE ${TORCH_ROOT}/lib)
target_link_libraries(torch_libraries INTERFACE torch_cpu)

add_library(torch_cuda_libraries INTERFACE)
target_compile_definitions(torch_cuda_libraries INTERFACE USE_CUDA=1)
target_link_libraries(torch_cuda_libraries INTERFACE torch_cuda)
