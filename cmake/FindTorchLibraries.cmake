# Locates the torch installed in the build's Python (torch.utils.cmake_prefix_path) and exposes
# its headers and libraries as the imported targets `torch_libraries` and `torch_cuda_libraries`.
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
target_compile_definitions(torch_libraries INTERFACE _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI})
target_link_directories(torch_libraries INTERFACE ${TORCH_ROOT}/lib)
target_link_libraries(torch_libraries INTERFACE torch torch_cpu c10)

add_library(torch_cuda_libraries INTERFACE)
target_compile_definitions(torch_cuda_libraries INTERFACE USE_CUDA=1)
target_link_libraries(torch_cuda_libraries INTERFACE torch_cuda c10_cuda)
