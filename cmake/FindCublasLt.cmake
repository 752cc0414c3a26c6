# cuBLASLt ships with the CUDA toolkit, or (for pip-installed torch) in the nvidia-cublas wheel
# beside torch. Look in the toolkit first, then in site-packages/nvidia/*.
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import glob, os, site; roots=[os.path.join(p, 'nvidia') for p in site.getsitepackages()]; print(';'.join(sorted({os.path.dirname(os.path.dirname(h)) for r in roots for h in glob.glob(os.path.join(r, '*', 'include', 'cublasLt.h'))})))"
  OUTPUT_VARIABLE _nvidia_wheel_roots
  OUTPUT_STRIP_TRAILING_WHITESPACE)
find_path(CUBLASLT_INCLUDE_DIR cublasLt.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ${_nvidia_wheel_roots}
  PATH_SUFFIXES include)
find_library(CUBLASLT_LIBRARY
  NAMES cublasLt libcublasLt.so.13 libcublasLt.so.12
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_nvidia_wheel_roots}
  PATH_SUFFIXES lib lib64)
# cuBLAS itself: the fallback for problems cuBLASLt has no algorithm for.
find_library(CUBLAS_LIBRARY
  NAMES cublas libcublas.so.13 libcublas.so.12
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_nvidia_wheel_roots}
  PATH_SUFFIXES lib lib64)
if(NOT CUBLASLT_INCLUDE_DIR OR NOT CUBLASLT_LIBRARY OR NOT CUBLAS_LIBRARY)
  message(FATAL_ERROR "megatron_eopt: cuBLAS / cuBLASLt not found in the CUDA toolkit nor in site-packages/nvidia")
endif()
# Torch's CUDA headers also include cusparse.h and cusolverDn.h: with pip-provided libraries
# those live in the same wheels, so every nvidia/*/include folder goes on the include path.
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import glob, os, site; print(';'.join(sorted(d for p in site.getsitepackages() for d in glob.glob(os.path.join(p, 'nvidia', '*', 'include')))))"
  OUTPUT_VARIABLE NVIDIA_WHEEL_INCLUDE_DIRS
  OUTPUT_STRIP_TRAILING_WHITESPACE)
message(STATUS "megatron_eopt: cuBLASLt ${CUBLASLT_LIBRARY}, cuBLAS ${CUBLAS_LIBRARY}")
