# The C++ sources a build of the libraries compiles (csrc/, cmake/ and CMakeLists.txt), one
# "<sha256>  <path relative to the checkout>" line each, sorted by path: installed next to _C.so
# as _C_sources.sha256. A checkout that has no compiled library of its own loads the installed
# one and compares its own sources with this list (megatron_eopt/_library.py computes the same
# lines), so a stale installed library is named at import rather than met as a wrong op.
#
# include()d by CMakeLists.txt, or run as a script (what the tests check the Python side against):
#   cmake -DROOT=<checkout> -DOUT=<file> -P cmake/SourceManifest.cmake

function(megatron_eopt_source_manifest root out)
  set(patterns "")
  foreach(dir csrc cmake)
    foreach(ext cpp h cu cuh cmake)
      list(APPEND patterns "${root}/${dir}/*.${ext}")  # absolute: a script runs from any folder
    endforeach()
  endforeach()
  file(GLOB_RECURSE files RELATIVE "${root}" ${patterns})
  list(APPEND files CMakeLists.txt)
  list(SORT files)
  set(lines "")
  foreach(f IN LISTS files)
    file(SHA256 "${root}/${f}" hash)
    string(APPEND lines "${hash}  ${f}\n")
  endforeach()
  file(WRITE "${out}" "${lines}")
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(NOT DEFINED ROOT OR NOT DEFINED OUT)
    message(FATAL_ERROR "usage: cmake -DROOT=<checkout> -DOUT=<file> -P cmake/SourceManifest.cmake")
  endif()
  megatron_eopt_source_manifest("${ROOT}" "${OUT}")
endif()
